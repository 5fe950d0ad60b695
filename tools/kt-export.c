/* kt-export: a libkt fine-tune back to Hugging Face (kt/hf_export.h).
 *
 *   kt-export RUN.safetensors --import OUT/import.json (--peft DIR | --hf DIR [--merged])
 *             [--source MODEL_DIR] [--lora-rank R] [--lora-alpha A] [--targets a,b,...]
 *
 * The settings come from kt-import's import.json; the flags override them (without --import,
 * --source is required, and --lora-alpha when the run holds adapters). Errors:
 * "kt-export: <message>" on stderr, exit 1; usage errors exit 2. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kt/hf_export.h"
#include "tools/common/usage.h"

#define TOOL "kt-export"

typedef struct export_args {
    const char *run, *import, *source, *model_type, *peft, *hf, *rank, *alpha, *targets;
    int merged;
} export_args;

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kt-export RUN.safetensors --import OUT/import.json\n"
            "                 (--peft DIR | --hf DIR [--merged])\n"
            "                 [--source MODEL_DIR] [--lora-rank R] [--lora-alpha A]\n"
            "                 [--targets q_proj,v_proj,...] [--model-type T]\n"
            "\n"
            "Writes what kt-train saved (RUN) for a model kt-import made back in Hugging Face\n"
            "form, as a new directory DIR (written whole or not at all; DIR must not exist).\n"
            "\n"
            "  --peft DIR        a PEFT LoRA adapter: adapter_config.json and\n"
            "                    adapter_model.safetensors for peft.PeftModel.from_pretrained\n"
            "  --hf DIR          a full checkpoint in the source's names, dtypes and shards,\n"
            "                    with config.json, generation and tokenizer files copied\n"
            "  --merged          with --hf: fold the LoRA deltas W + (alpha/r) B A into the\n"
            "                    weights (needed for a LoRA run, which --hf alone refuses)\n"
            "  --import FILE     kt-import's import.json: the source directory, model type,\n"
            "                    LoRA rank, alpha and targets\n"
            "  --source DIR      the source checkpoint (overrides import.json's)\n"
            "  --lora-rank R     the adapters' rank, checked against the run (0: any)\n"
            "  --lora-alpha A    the adapters' alpha (overrides import.json's)\n"
            "  --targets LIST    comma-separated modules every adapter must be on\n"
            "  --model-type T    config.json's model_type (overrides import.json's)\n"
            "  -h, --help        this text\n"
            "\n"
            "Exit status: 0 success, 1 error, 2 usage error.\n");
}

/* 0 on success, 2 (usage error), or -1 after --help. */
static int parse_args(int argc, char **argv, export_args *a)
{
    memset(a, 0, sizeof *a);
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        const char **value = NULL;
        if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
            usage(stdout);
            return -1;
        } else if (strcmp(arg, "--merged") == 0) {
            a->merged = 1;
        } else if (strcmp(arg, "--import") == 0) {
            value = &a->import;
        } else if (strcmp(arg, "--source") == 0) {
            value = &a->source;
        } else if (strcmp(arg, "--model-type") == 0) {
            value = &a->model_type;
        } else if (strcmp(arg, "--peft") == 0) {
            value = &a->peft;
        } else if (strcmp(arg, "--hf") == 0) {
            value = &a->hf;
        } else if (strcmp(arg, "--lora-rank") == 0) {
            value = &a->rank;
        } else if (strcmp(arg, "--lora-alpha") == 0) {
            value = &a->alpha;
        } else if (strcmp(arg, "--targets") == 0) {
            value = &a->targets;
        } else if (arg[0] == '-') {
            return kt_tool_usage_error(TOOL, "unknown option '%s'", arg);
        } else if (a->run == NULL) {
            a->run = arg;
        } else {
            return kt_tool_usage_error(TOOL, "one run file only, not also '%s'", arg);
        }
        if (value != NULL) {
            if (i + 1 >= argc)
                return kt_tool_usage_error(TOOL, "%s needs a value", arg);
            *value = argv[++i];
        }
    }
    if (a->run == NULL)
        return kt_tool_usage_error(TOOL, "no run file given");
    if ((a->peft == NULL) == (a->hf == NULL))
        return kt_tool_usage_error(TOOL, "give one of --peft DIR and --hf DIR");
    if (a->merged && a->hf == NULL)
        return kt_tool_usage_error(TOOL, "--merged goes with --hf");
    if (a->import == NULL && a->source == NULL)
        return kt_tool_usage_error(TOOL, "give --import OUT/import.json or --source MODEL_DIR");
    return 0;
}

/* Splits "a,b,c" in place into list (NULL-terminated); 2 on a bad list. */
static int split_targets(char *s, const char **list)
{
    int n = 0;
    for (char *tok = strtok(s, ","); tok != NULL; tok = strtok(NULL, ",")) {
        if (n == KT_HF_EXPORT_MAX_TARGETS)
            return kt_tool_usage_error(TOOL, "more than %d --targets", KT_HF_EXPORT_MAX_TARGETS);
        list[n++] = tok;
    }
    if (n == 0)
        return kt_tool_usage_error(TOOL, "--targets needs module names, e.g. q_proj,v_proj");
    list[n] = NULL;
    return 0;
}

static int run(const export_args *a)
{
    static kt_hf_import_record record;
    kt_hf_export_options o;
    memset(&o, 0, sizeof o);
    if (a->import != NULL) {
        if (kt_hf_read_import_record(a->import, &record) != KT_OK) {
            fprintf(stderr, TOOL ": %s\n", kt_last_error());
            return 1;
        }
        kt_hf_export_options_from_record(&record, &o);
    }
    if (a->source != NULL)
        o.source_dir = a->source;
    if (a->model_type != NULL)
        o.model_type = a->model_type;
    if (a->rank != NULL) {
        long long r;
        if (kt_tool_parse_int(TOOL, "--lora-rank", a->rank, 0, 1 << 20, &r) != 0)
            return 2;
        o.lora_rank = r;
    }
    if (a->alpha != NULL) {
        double x;
        if (kt_tool_parse_real(TOOL, "--lora-alpha", a->alpha, 0, 1e6, KT_TOOL_LO_OPEN, &x) != 0)
            return 2;
        o.lora_alpha = x;
    }
    static char targets_text[4096];
    static const char *targets[KT_HF_EXPORT_MAX_TARGETS + 1];
    if (a->targets != NULL) {
        snprintf(targets_text, sizeof targets_text, "%s", a->targets);
        if (split_targets(targets_text, targets) != 0)
            return 2;
        o.targets = targets;
    }
    o.merged = a->merged;
    kt_status st = a->peft != NULL ? kt_hf_export_peft(a->run, &o, a->peft)
                                   : kt_hf_export_full(a->run, &o, a->hf);
    if (st != KT_OK) {
        fprintf(stderr, TOOL ": %s\n", kt_last_error());
        return 1;
    }
    printf("%s: wrote %s\n", TOOL, a->peft != NULL ? a->peft : a->hf);
    return 0;
}

int main(int argc, char **argv)
{
    export_args a;
    int rc = parse_args(argc, argv, &a);
    if (rc == 0)
        rc = run(&a);
    else if (rc < 0)
        rc = 0;
    int out = tool_finish_stdout(TOOL);
    return rc != 0 ? rc : out;
}
