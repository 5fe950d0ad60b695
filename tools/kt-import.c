/* kt-import: a Hugging Face model directory (config.json + safetensors) as a libkt program
 * (docs/huggingface.md); the tool form of kt_hf_import (kt/hf.h).
 *
 *   kt-import MODEL_DIR -o OUT [--batch B] [--seq S] [--context C] [--dtype f32|bf16]
 *             [--lora-rank R --lora-alpha A [--lora-targets q_proj,k_proj,...]] [--aux-loss]
 *
 * Exit status: 0 imported; 1 the model or checkpoint was refused or OUT could not be written
 * (nothing of OUT changed); 2 a usage error. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kt/kt.h"
#include "tools/common/usage.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kt-import MODEL_DIR -o OUT [options]\n"
            "\n"
            "Reads a Hugging Face model directory (config.json and model.safetensors) and\n"
            "writes OUT/model.ktg (the model in the .ktg language, the checkpoint's names),\n"
            "OUT/model.ktp (compiled for training), OUT/model_decode.ktg (its decode twin\n"
            "for kt-generate: a key/value cache) and OUT/import.json. The checkpoint must\n"
            "hold exactly the tensors the model needs. The weights stay in MODEL_DIR: run\n"
            "with kt-run / kt-train --params MODEL_DIR.\n"
            "\n"
            "architectures (model_type): mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v2,\n"
            "deepseek_v3, llama, qwen2, qwen3\n"
            "\n"
            "options:\n"
            "  -o OUT              the output directory (new, empty, or an earlier import's)\n"
            "  --batch B           sequences per step (default 1)\n"
            "  --seq S             tokens per sequence (default 128)\n"
            "  --context C         the decode twin's context: prompt and new tokens\n"
            "                      (default S; kt-generate -D C=... changes it)\n"
            "  --dtype f32|bf16    the dense weights' dtype (bf16: frozen, needs LoRA)\n"
            "  --lora-rank R       LoRA adapters of rank R (the base frozen)\n"
            "  --lora-alpha A      their scale is A / R (needed with --lora-rank)\n"
            "  --lora-targets LIST comma-separated PEFT module names: q_proj, k_proj, v_proj,\n"
            "                      o_proj, gate_proj, up_proj, down_proj (DeepSeek: q_a_proj,\n"
            "                      q_b_proj, kv_a_proj_with_mqa, kv_b_proj); default: all\n"
            "  --aux-loss          add router_aux_loss_coef x the load-balancing loss\n"
            "                      (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE)\n"
            "  --segments          an input segments [B, S] of document ids for every\n"
            "                      attention, so that kt-train's packed sequences (kt-data)\n"
            "                      never attend across documents\n"
            "  -h, --help          this text\n"
            "\n"
            "exit status: 0 imported, 1 refused or not written, 2 usage\n");
}

static int usage_error(const char *fmt, const char *arg)
{
    return kt_tool_usage_error("kt-import", fmt, arg);
}

typedef struct args {
    const char *model_dir, *out;
    kt_hf_options o;
    int alpha_given;
} args;

/* Returns 0, 2 (usage error) or -1 (--help printed). */
static int parse_args(args *a, int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        const char *s = argv[i];
        if (strcmp(s, "-h") == 0 || strcmp(s, "--help") == 0) {
            usage(stdout);
            return -1;
        }
        if (strcmp(s, "--aux-loss") == 0 || strcmp(s, "--segments") == 0) {
            *(s[2] == 'a' ? &a->o.aux_loss : &a->o.segments) = 1;
            continue;
        }
        int takes_value = strcmp(s, "-o") == 0 || strcmp(s, "--batch") == 0 ||
                          strcmp(s, "--seq") == 0 || strcmp(s, "--context") == 0 ||
                          strcmp(s, "--dtype") == 0 ||
                          strcmp(s, "--lora-rank") == 0 || strcmp(s, "--lora-alpha") == 0 ||
                          strcmp(s, "--lora-targets") == 0;
        if (takes_value) {
            if (i + 1 >= argc)
                return usage_error("%s needs a value", s);
            const char *v = argv[++i];
            long long n;
            if (strcmp(s, "-o") == 0) {
                a->out = v;
            } else if (strcmp(s, "--batch") == 0) {
                if (kt_tool_parse_int("kt-import", s, v, 1, 1 << 20, &n) != 0)
                    return 2;
                a->o.batch = n;
            } else if (strcmp(s, "--seq") == 0) {
                if (kt_tool_parse_int("kt-import", s, v, 1, 1 << 24, &n) != 0)
                    return 2;
                a->o.seq = n;
            } else if (strcmp(s, "--context") == 0) {
                if (kt_tool_parse_int("kt-import", s, v, 2, 1 << 24, &n) != 0)
                    return 2;
                a->o.context = n;
            } else if (strcmp(s, "--lora-rank") == 0) {
                if (kt_tool_parse_int("kt-import", s, v, 1, 4096, &n) != 0)
                    return 2;
                a->o.lora_rank = n;
            } else if (strcmp(s, "--dtype") == 0) {
                if (strcmp(v, "f32") == 0)
                    a->o.dtype = KT_F32;
                else if (strcmp(v, "bf16") == 0)
                    a->o.dtype = KT_BF16;
                else
                    return usage_error("--dtype is f32 or bf16, not '%s'", v);
            } else if (strcmp(s, "--lora-alpha") == 0) {
                double x;
                if (kt_tool_parse_real("kt-import", s, v, 0, 1e6, KT_TOOL_LO_OPEN, &x) != 0)
                    return 2;
                a->o.lora_alpha = (float)x;
                a->alpha_given = 1;
            } else {
                a->o.lora_targets = v;
            }
        } else if (s[0] == '-' && s[1] != '\0') {
            return usage_error("unknown option '%s'", s);
        } else if (a->model_dir != NULL) {
            return usage_error("more than one model directory ('%s')", s);
        } else {
            a->model_dir = s;
        }
    }
    if (a->model_dir == NULL)
        return usage_error("%s", "no model directory given");
    if (a->out == NULL)
        return usage_error("%s", "no output directory given (-o OUT)");
    if (a->o.lora_rank > 0 && !a->alpha_given)
        return usage_error("%s", "--lora-rank needs --lora-alpha");
    if (a->o.lora_rank == 0 && (a->alpha_given || a->o.lora_targets != NULL))
        return usage_error("%s", "--lora-alpha and --lora-targets need --lora-rank");
    if (a->o.dtype == KT_BF16 && a->o.lora_rank == 0)
        return usage_error("%s", "--dtype bf16 needs LoRA (--lora-rank): full fine-tuning "
                                 "keeps f32 master weights");
    return 0;
}

int main(int argc, char **argv)
{
    args a;
    memset(&a, 0, sizeof a);
    int rc = parse_args(&a, argc, argv);
    if (rc == 0 && kt_check_environment() != KT_OK)
        rc = kt_tool_usage_error("kt-import", "%s", kt_last_error());
    if (rc == 0) {
        if (kt_hf_import(a.model_dir, &a.o, a.out) != KT_OK) {
            fprintf(stderr, "kt-import: %s\n", kt_last_error());
            rc = 1;
        } else {
            printf("imported %s into %s\n", a.model_dir, a.out);
        }
    } else if (rc < 0) {
        rc = 0;
    }
    int out = tool_finish_stdout("kt-import");
    return rc != 0 ? rc : out;
}
