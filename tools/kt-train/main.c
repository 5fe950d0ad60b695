/* kt-train: trains a compiled program (.ktp) or a model description (.ktg) on a token file,
 * on one rank or, under a launcher, context-parallel over several (docs/parallel.md,
 * docs/training.md).
 *
 *   kt-train model.ktp|model.ktg [-D NAME=VALUE] --data TOKENS --steps N [options]
 *
 * Exit status: 0 success, 1 error (one line "kt-train: ..." naming what and where), 2 usage
 * error. */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tools/kt-train/trainer.h"
#include "tools/common/files.h"
#include "tools/common/usage.h"

static void usage(FILE *f)
{
    fprintf(f,
        "usage: kt-train model.ktp|model.ktg [-D NAME=VALUE ...] --data TOKENS --steps N\n"
        "                [options]\n"
        "       kt-train [model] --resume RUN_DIR|STEP_DIR [options]\n"
        "\n"
        "Trains a libkt program on a file of token ids: each optimizer step feeds --accum\n"
        "windows of the file to the program's token input (and each window shifted by one\n"
        "token to its targets input), runs forward and backward on each, and applies the\n"
        "optimizer to their mean gradient. Under a launcher (kt-launch -n W, torchrun,\n"
        "mpirun, srun) the W ranks train one model context-parallel: the window is W times\n"
        "the program's token count, each rank feeds its slice along the inputs' shard\n"
        "dimension (.ktg 'shard'), rank 0 runs the MoE experts, and gradients and the loss\n"
        "are averaged over the ranks. Compile the program with the per-rank token count.\n"
        "\n"
        "model:\n"
        "  model.ktp             a compiled program (kt-graphc)\n"
        "  model.ktg             a model description, compiled here as kt-graphc does\n"
        "  -D NAME=VALUE         with a .ktg: override its const NAME (-D B=8 -D T=256 sets\n"
        "                        the batch and sequence length); repeatable, at most 64\n"
        "                        (with --resume the model may be left out: the\n"
        "                        checkpoint's program.ktp is used)\n"
        "\n"
        "data:\n"
        "  --data FILE           token ids: kt-data's prepared file (tokens, loss mask,\n"
        "                        documents), or a flat binary file; step s reads windows\n"
        "                        s*N .. s*N+N-1 (N: --accum) of T+1 tokens from token w*T\n"
        "                        on (T: tokens per window over all ranks), wrapping around\n"
        "                        the end; ids outside the model's vocabulary are an error\n"
        "  --allow-cross-document  train on packed documents with a program that has no\n"
        "                        'segments' input (its attention then crosses them)\n"
        "  --data-format F       a flat file's ids: u8 (any file as bytes), u16 or i32,\n"
        "                        little-endian (default u16)\n"
        "  --data-header BYTES   skip a header (1024 for llm.c's .bin files; default 0)\n"
        "  --input-tokens NAME   the program input that gets the tokens (default tokens, or\n"
        "                        input_ids when the program has no tokens input)\n"
        "  --input-labels NAME   one that gets the same tokens, which the program shifts\n"
        "                        itself (default labels: kt-import's programs)\n"
        "  --input-targets NAME  the one that gets the next tokens (default targets; not fed\n"
        "                        when the program has no such input)\n"
        "\n");
    fprintf(f,
        "training:\n"
        "  --steps N             optimizer steps in the whole run (required; 0 with --save\n"
        "                        or --run-dir writes the initial state)\n"
        "  --accum N             gradient accumulation: windows per optimizer step, their\n"
        "                        gradients averaged (default 1)\n"
        "  --optimizer O         adamw (default) or sgd\n"
        "  --lr X                peak learning rate (default 1e-3 for adamw, 0.1 for sgd)\n"
        "  --schedule S          constant (default), linear or cosine: after the warm-up,\n"
        "                        linear and cosine fall from --lr to --min-lr at --steps\n"
        "  --warmup N            linear warm-up from 0 over the first N steps, for every\n"
        "                        schedule (default 0)\n"
        "  --min-lr X            where linear and cosine end (default 0)\n"
        "  --weight-decay X      decoupled (AdamW) or L2 (SGD) weight decay (default 0)\n"
        "  --beta1 X, --beta2 X  AdamW's moment decay rates (default 0.9 and 0.999)\n"
        "  --momentum X          SGD's momentum (default 0)\n"
        "  --clip X              clip the gradients to this global L2 norm, 0 off (default\n"
        "                        1.0); the norm is that of the averaged gradient\n"
        "  --seed S              parameter and expert initialisation (default 1); the same\n"
        "                        on every rank; nothing random happens after it\n"
        "  --params FILE         start from these parameters (safetensors, every one of the\n"
        "                        program's and nothing else) instead of the seed's; a file\n"
        "                        --save wrote brings the experts too, whole. FILE, a DIR\n"
        "                        with model.safetensors.index.json or model.safetensors, or\n"
        "                        a sharded checkpoint's index.json; float dtypes convert.\n"
        "                        In a program that marks what a checkpoint holds ('loaded',\n"
        "                        as kt-import writes), the other parameters (LoRA adapters)\n"
        "                        may be absent: they start from the seed\n"
        "  --threads N           threads per rank (default: KT_NUM_THREADS or the CPU count)\n"
        "\n");
    fprintf(f,
        "evaluation:\n"
        "  --eval-data FILE      held-out tokens (the same formats as --data): at the start\n"
        "                        the unigram baseline (the --data file's token frequencies\n"
        "                        scored on it), at the end the held-out loss, perplexity and\n"
        "                        bits per byte (when the file says its source bytes), and\n"
        "                        their ratio to the baseline\n"
        "  --eval-every N        also evaluate every N steps (default: only at the end)\n"
        "  --eval-windows M      evaluate on the first M windows (default: every whole one)\n"
        "\n"
        "run directory and resume:\n"
        "  --run-dir DIR         checkpoints DIR/step-NNNNNNNN/ (session.safetensors: the\n"
        "                        parameters, experts, adapters and optimizer state;\n"
        "                        program.ktp; run.json: the step, data position, random\n"
        "                        state, settings and file hashes), each written whole or not\n"
        "                        at all, at the end of the run and on SIGINT/SIGTERM\n"
        "  --save-every N        also a checkpoint every N steps\n"
        "  --keep K              keep the newest K checkpoints (default 3)\n"
        "  --resume DIR          go on from a checkpoint: a run directory's newest, or a\n"
        "                        step directory. The model, --data, --steps and every\n"
        "                        option not given again come from the checkpoint; one\n"
        "                        given again must agree (a difference is refused, naming\n"
        "                        it; --steps may grow with a constant schedule).\n"
        "                        Checkpoints go on into that run\n"
        "                        directory, or into --run-dir. Not with --params or\n"
        "                        --experts\n"
        "  SIGINT, SIGTERM       finish the step, write a checkpoint (with a run directory),\n"
        "                        exit by the signal (status 130, 143); a second one stops\n"
        "                        at once\n"
        "\n"
        "MoE layers (one per moe op; E and k from the program's router, H from its input):\n"
        "  --moe-inter I         expert intermediate size, for moe ops that do not say\n"
        "                        theirs (their .ktg 'intermediate'; default 2*H)\n"
        "  --moe-dtype D         expert weights f32 (default), bf16, or int8 / int4:\n"
        "                        quantized frozen experts (with --moe-mode lora or frozen;\n"
        "                        quantized as they are loaded or drawn)\n"
        "  --moe-group G         int4: inputs per scale, 32, 64 (default) or 128\n"
        "  --moe-mode M          full (default: train every expert weight; needs f32), lora\n"
        "                        (adapters on every expert's gate, up and down) or frozen\n"
        "  --lora-rank R         --moe-mode lora: the adapters' rank (default 8)\n"
        "  --lora-alpha A        --moe-mode lora: their scale is A / R (default 16)\n"
        "  --moe-parallel P      several ranks: rank0 (rank 0 holds every expert) or ep (each\n"
        "                        rank its share; --save then writes rank r's experts to\n"
        "                        FILE.rank<r> besides rank 0's FILE); default: each moe op's\n"
        "                        'parallel'\n"
        "  --experts FILE        start from these expert weights (as kt_moe_save_layers\n"
        "                        writes them: every layer's, and no other model's experts or\n"
        "                        adapters); not with a --params file that holds experts\n"
        "\n"
        "output:\n"
        "  --log-every K         on rank 0, when stdout is not a terminal, a line every K\n"
        "                        steps (default 1): 'step 3/20 loss 6.2145 lr 1.0e-03\n"
        "                        (123 ms, 2100 tokens/s, elapsed 0:12, eta 1:03)'; on a\n"
        "                        terminal one live line with a bar instead; at the end the\n"
        "                        process's peak memory: 'peak RSS 123.4 MB'. With a run\n"
        "                        directory also DIR/metrics.jsonl (every step and\n"
        "                        evaluation) and DIR/loss.svg (the curves)\n"
        "  --losses FILE         one loss per step (%%.9g), the mean over the step's windows\n"
        "                        and the ranks\n"
        "  --save FILE           at the end, on rank 0, one safetensors file: the\n"
        "                        parameters by name, the experts (and LoRA adapters) of\n"
        "                        every MoE layer under its moe op's names (by default\n"
        "                        moe.<layer>.experts.<e>.<proj>.weight),\n"
        "                        and the optimizer state; written whole or not at all (a\n"
        "                        kill or a full disk leaves the previous file as it was)\n"
        "  -h, --help            this text\n"
        "\n"
        "Exit status: 0 success, 1 error, 2 usage error, 130/143 stopped by SIGINT/SIGTERM.\n");
}

static int usage_error(const char *fmt, const char *arg)
{
    return kt_tool_usage_error("kt-train", fmt, arg);
}

/* ---- options ------------------------------------------------------------------------------ */

static int parse_i64(const char *opt, const char *v, int64_t lo, int64_t *out)
{
    long long x;
    if (kt_tool_parse_int("kt-train", opt, v, lo, LLONG_MAX, &x) != 0)
        return 2;
    *out = x;
    return 0;
}

static int parse_choice(const char *opt, const char *v, const char *const *names, int n,
                        int *out)
{
    for (int i = 0; i < n; i++)
        if (strcmp(v, names[i]) == 0) {
            *out = i;
            return 0;
        }
    return kt_tool_usage_error("kt-train", "%s: unknown value '%s'", opt, v);
}

/* a number in [lo, hi], an end in `open` (KT_TOOL_*_OPEN) excluded */
static int parse_float(const char *opt, const char *v, double lo, double hi, int open,
                       float *out)
{
    double x;
    if (kt_tool_parse_real("kt-train", opt, v, lo, hi, open, &x) != 0)
        return 2;
    *out = (float)x;
    return 0;
}

static int parse_define(train_args *a, const char *spec)
{
    const char *eq = strchr(spec, '=');
    if (eq == NULL || eq == spec)
        return usage_error("-D needs NAME=VALUE, not '%s'", spec);
    if (a->n_defines == (int)(sizeof a->defines / sizeof a->defines[0]))
        return usage_error("too many -D options (at most 64), at '%s'", spec);
    char opt[80];
    snprintf(opt, sizeof opt, "-D %.*s", (int)(eq - spec < 64 ? eq - spec : 64), spec);
    long long v;
    if (kt_tool_parse_int("kt-train", opt, eq + 1, LLONG_MIN, LLONG_MAX, &v) != 0)
        return 2;
    size_t n = (size_t)(eq - spec);
    char *name = malloc(n + 1);
    if (name == NULL)
        return usage_error("out of memory at '%s'", spec);
    memcpy(name, spec, n);
    name[n] = '\0';
    a->defines[a->n_defines++] = (kt_ktg_define){.name = name, .value = v};
    return 0;
}

/* Options that take a value; 0 done, 2 usage error. */
static int parse_value(train_args *a, const char *opt, const char *v)
{
    static const char *const formats[] = {"u8", "u16", "i32"};
    static const char *const optimizers[] = {"sgd", "adamw"};   /* kt_optimizer_kind order */
    static const char *const modes[] = {"frozen", "lora", "full"}; /* kt_moe_mode order */
    static const char *const dtypes[] = {"f32", "bf16", "int8", "int4"};
    static const char *const schedules[] = {"constant", "cosine", "linear"}; /* enum order */
    int64_t x;
    int c, rc = 0;
    const char **file = strcmp(opt, "--data") == 0            ? &a->data
                      : strcmp(opt, "--params") == 0          ? &a->params
                      : strcmp(opt, "--experts") == 0         ? &a->experts
                      : strcmp(opt, "--save") == 0            ? &a->save
                      : strcmp(opt, "--losses") == 0          ? &a->losses
                      : strcmp(opt, "--input-tokens") == 0    ? &a->tokens_input
                      : strcmp(opt, "--input-targets") == 0   ? &a->targets_input
                      : strcmp(opt, "--input-labels") == 0    ? &a->labels_input
                      : strcmp(opt, "--eval-data") == 0       ? &a->eval_data
                      : strcmp(opt, "--run-dir") == 0         ? &a->run_dir
                      : strcmp(opt, "--resume") == 0          ? &a->resume
                                                              : NULL;
    if (file != NULL) {
        *file = v;
        a->tokens_input_set |= file == &a->tokens_input;
    } else if (strcmp(opt, "-D") == 0) {
        rc = parse_define(a, v);
    } else if (strcmp(opt, "--data-format") == 0) {
        if ((rc = parse_choice(opt, v, formats, 3, &c)) == 0)
            a->token_bytes = c == 0 ? 1 : c == 1 ? 2 : 4;
    } else if (strcmp(opt, "--data-header") == 0) {
        rc = parse_i64(opt, v, 0, &a->data_header);
    } else if (strcmp(opt, "--steps") == 0) {
        rc = parse_i64(opt, v, 0, &a->steps);
        a->set_flags |= TRAIN_SET_STEPS;
    } else if (strcmp(opt, "--accum") == 0) {
        if ((rc = parse_i64(opt, v, 1, &a->accum)) == 0 && a->accum > 65536)
            rc = usage_error("--accum %s is more than 65536", v);
    } else if (strcmp(opt, "--warmup") == 0) {
        rc = parse_i64(opt, v, 0, &a->warmup);
    } else if (strcmp(opt, "--eval-every") == 0 || strcmp(opt, "--eval-windows") == 0) {
        rc = parse_i64(opt, v, 1, opt[7] == 'e' ? &a->eval_every : &a->eval_windows);
        a->set_flags |= TRAIN_SET_EVAL;
    } else if (strcmp(opt, "--save-every") == 0) {
        rc = parse_i64(opt, v, 1, &a->save_every);
    } else if (strcmp(opt, "--keep") == 0) {
        rc = parse_i64(opt, v, 1, &a->keep);
        a->set_flags |= TRAIN_SET_KEEP;
    } else if (strcmp(opt, "--log-every") == 0) {
        rc = parse_i64(opt, v, 1, &a->log_every);
    } else if (strcmp(opt, "--seed") == 0) {
        if ((rc = parse_i64(opt, v, 0, &x)) == 0)
            a->seed = (uint64_t)x;
    } else if (strcmp(opt, "--moe-inter") == 0) {
        rc = parse_i64(opt, v, 1, &a->moe_inter);
    } else if (strcmp(opt, "--lora-rank") == 0) {
        if ((rc = parse_i64(opt, v, 1, &a->lora_rank)) == 0 && a->lora_rank > 256)
            rc = usage_error("--lora-rank %s is more than 256 (the MoE layer's limit)", v);
    } else if (strcmp(opt, "--lora-alpha") == 0) {
        rc = parse_float(opt, v, 0, 1e6, KT_TOOL_LO_OPEN, &a->lora_alpha);
    } else if (strcmp(opt, "--threads") == 0) {
        if ((rc = parse_i64(opt, v, 1, &x)) == 0 && x > 1024)
            rc = usage_error("--threads %s is more than 1024 (libkt's pool limit)", v);
        if (rc == 0)
            a->threads = (int)x;
    } else if (strcmp(opt, "--optimizer") == 0) {
        if ((rc = parse_choice(opt, v, optimizers, 2, &c)) == 0)
            a->optimizer = (kt_optimizer_kind)c;
    } else if (strcmp(opt, "--schedule") == 0) {
        if ((rc = parse_choice(opt, v, schedules, 3, &c)) == 0)
            a->schedule = (kt_lr_schedule_kind)c;
    } else if (strcmp(opt, "--moe-mode") == 0) {
        if ((rc = parse_choice(opt, v, modes, 3, &c)) == 0)
            a->moe_mode = (kt_moe_mode)c;
    } else if (strcmp(opt, "--moe-parallel") == 0) {
        static const char *const pars[] = {"rank0", "ep"}; /* kt_moe_parallel order */
        if ((rc = parse_choice(opt, v, pars, 2, &c)) == 0)
            a->moe_parallel = c == 0 ? KT_MOE_PARALLEL_ALL_RANK0 : KT_MOE_PARALLEL_ALL_EP;
    } else if (strcmp(opt, "--moe-dtype") == 0) {
        if ((rc = parse_choice(opt, v, dtypes, 4, &c)) == 0) {
            a->moe_dtype = c == 0 ? KT_F32 : KT_BF16;
            a->moe_quant = c == 2 ? KT_MOE_QUANT_INT8 : c == 3 ? KT_MOE_QUANT_INT4 : KT_MOE_QUANT_NONE;
        }
    } else if (strcmp(opt, "--moe-group") == 0) {
        static const char *const groups[] = {"32", "64", "128"};
        if ((rc = parse_choice(opt, v, groups, 3, &c)) == 0)
            a->moe_group = 32 << c;
    } else if (strcmp(opt, "--lr") == 0) {
        rc = parse_float(opt, v, 0, 1e6, KT_TOOL_LO_OPEN, &a->lr);
    } else if (strcmp(opt, "--min-lr") == 0) {
        rc = parse_float(opt, v, 0, 1e6, 0, &a->min_lr);
        a->set_flags |= TRAIN_SET_MIN_LR;
    } else if (strcmp(opt, "--weight-decay") == 0) {
        rc = parse_float(opt, v, 0, 1e6, 0, &a->weight_decay);
    } else if (strcmp(opt, "--beta1") == 0 || strcmp(opt, "--beta2") == 0) {
        /* 0 would mean the library's default: only rates above it are taken */
        rc = parse_float(opt, v, 0, 1, KT_TOOL_LO_OPEN | KT_TOOL_HI_OPEN,
                         opt[6] == '1' ? &a->beta1 : &a->beta2);
        a->set_flags |= TRAIN_SET_BETAS;
    } else if (strcmp(opt, "--momentum") == 0) {
        rc = parse_float(opt, v, 0, 1, KT_TOOL_HI_OPEN, &a->momentum);
        a->set_flags |= TRAIN_SET_MOMENTUM;
    } else if (strcmp(opt, "--clip") == 0) {
        rc = parse_float(opt, v, 0, 1e30, 0, &a->clip);
    } else {
        rc = usage_error("unknown option '%s'", opt);
    }
    return rc;
}

static int takes_value(const char *opt)
{
    static const char *const opts[] = {
        "--data", "--data-format", "--data-header", "--input-tokens", "--input-targets",
        "--input-labels",
        "--steps", "--optimizer", "--lr", "--seed", "--params", "--threads", "--moe-inter",
        "--moe-dtype", "--moe-group", "--moe-mode", "--moe-parallel", "--lora-rank", "--lora-alpha", "--experts",
        "--log-every",
        "--losses", "--save", "-D", "--accum", "--weight-decay", "--beta1", "--beta2",
        "--momentum", "--schedule", "--warmup", "--min-lr", "--clip", "--eval-data",
        "--eval-every", "--eval-windows", "--run-dir", "--save-every", "--keep", "--resume"};
    for (size_t i = 0; i < sizeof opts / sizeof opts[0]; i++)
        if (strcmp(opt, opts[i]) == 0)
            return 1;
    return 0;
}

/* Options that contradict each other or ask for what cannot happen: a usage error naming
 * them, before anything is read. */
static int check_contradictions(const train_args *a)
{
    const char *ext = a->program != NULL ? strrchr(a->program, '.') : NULL;
    if (a->n_defines > 0 && (ext == NULL || strcmp(ext, ".ktg") != 0))
        return usage_error("-D overrides a .ktg model's consts; %s is not a .ktg",
                           a->program != NULL ? a->program : "the checkpoint's program.ktp");
    if (a->resume != NULL && a->params != NULL)
        return usage_error("--resume %s brings the parameters: leave out --params", a->resume);
    if (a->resume != NULL && a->experts != NULL)
        return usage_error("--resume %s brings the experts: leave out --experts", a->resume);
    if (a->save_every > 0 && a->run_dir == NULL && a->resume == NULL)
        return usage_error("%s", "--save-every writes checkpoints into a run directory: give "
                           "--run-dir DIR (or --resume one)");
    if ((a->set_flags & TRAIN_SET_KEEP) && a->run_dir == NULL && a->resume == NULL)
        return usage_error("%s", "--keep counts a run directory's checkpoints: give --run-dir "
                           "DIR (or --resume one)");
    if ((a->set_flags & TRAIN_SET_EVAL) && a->eval_data == NULL)
        return usage_error("%s", "--eval-every and --eval-windows need the held-out tokens: "
                           "give --eval-data FILE");
    if ((a->set_flags & TRAIN_SET_MOMENTUM) && a->optimizer != KT_OPTIM_SGD)
        return usage_error("%s", "--momentum is SGD's: add --optimizer sgd, or use --beta1 "
                           "with adamw");
    if ((a->set_flags & TRAIN_SET_BETAS) && a->optimizer != KT_OPTIM_ADAMW)
        return usage_error("%s", "--beta1 and --beta2 are AdamW's: leave them out with "
                           "--optimizer sgd (its momentum is --momentum)");
    if ((a->set_flags & TRAIN_SET_MIN_LR) && a->schedule == KT_LR_CONSTANT)
        return usage_error("%s", "--min-lr is where a linear or cosine schedule ends: add "
                           "--schedule linear or cosine");
    if (a->min_lr > a->lr)
        return kt_tool_usage_error("kt-train", "--min-lr %g is above --lr %g: a schedule only "
                                   "falls", (double)a->min_lr, (double)a->lr);
    if (a->steps == 0 && a->save == NULL && a->run_dir == NULL)
        return usage_error("%s", "--steps 0 trains nothing: it only writes the initial state, "
                           "with --save FILE or --run-dir DIR");
    if (a->steps == 0 && a->resume != NULL)
        return usage_error("%s", "--steps 0 with --resume: --steps is the run's whole length, "
                           "not the steps still to do");
    return 0;
}

/* ---- --resume without the options repeated ---------------------------------------------- */

static int given(int argc, char **argv, const char *opt)
{
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], opt) == 0)
            return 1;
    return 0;
}

/* The options a checkpoint's run.json records under these keys; "0" (or "") stands for an
 * option that was not given (the ones from 1 up). */
static const struct resumed_option {
    const char *key, *opt;
} resumed_options[] = {
    {"data", "--data"},           {"eval_data", "--eval-data"},   {"data_header", "--data-header"},
    {"steps", "--steps"},         {"accum", "--accum"},           {"optimizer", "--optimizer"},
    {"lr", "--lr"},               {"weight_decay", "--weight-decay"},
    {"beta1", "--beta1"},         {"beta2", "--beta2"},           {"momentum", "--momentum"},
    {"schedule", "--schedule"},   {"warmup", "--warmup"},         {"min_lr", "--min-lr"},
    {"clip", "--clip"},           {"moe_inter", "--moe-inter"},   {"moe_dtype", "--moe-dtype"},
    {"moe_group", "--moe-group"}, {"moe_mode", "--moe-mode"},   {"lora_rank", "--lora-rank"},   {"lora_alpha", "--lora-alpha"},
    {"threads", "--threads"},     {"seed", "--seed"},             {"eval_every", "--eval-every"},
    {"eval_windows", "--eval-windows"}, {"save_every", "--save-every"}, {"keep", "--keep"},
    {"log_every", "--log-every"}};

static int parse_value(train_args *a, const char *opt, const char *v);

static int take_setting(train_args *a, int argc, char **argv, const char *opt, const char *v)
{
    if (given(argc, argv, opt) || v[0] == '\0' || strcmp(v, "0") == 0)
        return 0;
    /* what the checkpoint holds is not a contradiction of the command line's */
    int flags = a->set_flags;
    int rc = parse_value(a, opt, v);
    a->set_flags = flags;
    if (rc != 0)
        fprintf(stderr, "kt-train: (%s '%s' came from the checkpoint's run.json)\n", opt, v);
    return rc;
}

/* --resume: every option the run was started with and that is not given again is taken from
 * the checkpoint, so `kt-train --resume DIR` alone goes on as the run would have. 0, 1 after
 * train_error (the checkpoint cannot be read), or 2. */
static int take_resumed_settings(train_args *a, int argc, char **argv)
{
    static flat_json j; /* some 60 KB: not on the stack */
    if (resume_read_settings(a->resume, &j) != 0)
        return 1;
    int rc = 0;
    for (size_t i = 0; i < sizeof resumed_options / sizeof resumed_options[0] && rc == 0; i++) {
        char key[FLAT_JSON_PATH];
        snprintf(key, sizeof key, "settings.%s", resumed_options[i].key);
        const flat_json_field *f = flat_json_get(&j, key);
        if (f != NULL && f->is_string)
            rc = take_setting(a, argc, argv, resumed_options[i].opt, f->value);
    }
    /* the ones recorded in another form */
    const flat_json_field *f = flat_json_get(&j, "settings.data_format");
    static const char *const formats[] = {"", "u8", "u16", "", "i32"}; /* by token bytes */
    if (rc == 0 && f != NULL && strlen(f->value) == 1 && strchr("124", f->value[0]) != NULL)
        rc = take_setting(a, argc, argv, "--data-format", formats[f->value[0] - '0']);
    f = flat_json_get(&j, "settings.allow_cross_document");
    if (f != NULL && strcmp(f->value, "1") == 0 && !given(argc, argv, "--allow-cross-document"))
        a->allow_cross_document = 1;
    f = flat_json_get(&j, "settings.input_names");
    static const char *const inputs[] = {"--input-tokens", "--input-labels", "--input-targets"};
    static char names[3][160]; /* the option values point at them */
    const char *at = f != NULL ? f->value : NULL;
    for (int k = 0; k < 3 && at != NULL && rc == 0; k++) {
        const char *end = strchr(at, ',');
        size_t n = end != NULL ? (size_t)(end - at) : strlen(at);
        snprintf(names[k], sizeof names[k], "%.*s", (int)(n < 159 ? n : 159), at);
        rc = take_setting(a, argc, argv, inputs[k], names[k]);
        at = end != NULL ? end + 1 : NULL;
    }
    return rc;
}

/* 0 on success, 2 (usage error), 1 (an unreadable checkpoint), or -1 after --help. */
static int parse_args(int argc, char **argv, train_args *a)
{
    *a = (train_args){.tokens_input = "tokens", .targets_input = "targets",
                      .labels_input = "labels", .token_bytes = 2,
                      .log_every = 1, .lr = -1.0f, .optimizer = KT_OPTIM_ADAMW, .seed = 1,
                      .moe_dtype = KT_F32, .moe_mode = KT_MOE_FULL, .lora_rank = 8,
                      .lora_alpha = 16.0f, .steps = -1, .accum = 1, .beta1 = 0.9f,
                      .beta2 = 0.999f, .clip = 1.0f, .keep = 3, .schedule = KT_LR_CONSTANT};
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        int rc = 0;
        if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
            usage(stdout);
            return -1;
        } else if (strcmp(arg, "--allow-cross-document") == 0) {
            a->allow_cross_document = 1;
        } else if (strncmp(arg, "-D", 2) == 0 && arg[2] != '\0') {
            rc = parse_define(a, arg + 2);
        } else if (arg[0] == '-' && arg[1] != '\0') {
            if (!takes_value(arg))
                rc = usage_error("unknown option '%s'", arg);
            else if (i + 1 >= argc)
                rc = usage_error("%s needs a value", arg);
            else
                rc = parse_value(a, arg, argv[++i]);
        } else if (a->program == NULL) {
            a->program = arg;
            a->set_flags |= TRAIN_SET_PROGRAM;
        } else {
            rc = usage_error("unexpected argument '%s' (one program file only)", arg);
        }
        if (rc != 0)
            return rc;
    }
    if (a->resume != NULL) {
        int rc = take_resumed_settings(a, argc, argv);
        if (rc != 0)
            return rc;
    }
    if (a->program == NULL && a->resume == NULL)
        return usage_error("%s", "no program file given");
    if (a->data == NULL)
        return usage_error("%s", "--data is required");
    if (a->steps < 0)
        return usage_error("%s", "--steps is required");
    if (a->moe_mode == KT_MOE_FULL && a->moe_quant != KT_MOE_QUANT_NONE)
        return usage_error("--moe-dtype %s: quantized experts are frozen (they have no weight "
                           "gradient): use --moe-mode lora or frozen",
                           kt_moe_quant_name(a->moe_quant));
    if (a->moe_mode == KT_MOE_FULL && a->moe_dtype == KT_BF16)
        return usage_error("%s", "--moe-mode full trains f32 expert weights: use --moe-dtype "
                           "f32, or --moe-mode lora or frozen with bf16");
    if (a->moe_group != 0 && a->moe_quant != KT_MOE_QUANT_INT4)
        return usage_error("%s", "--moe-group is int4's: give it with --moe-dtype int4");
    if (a->lr < 0)
        a->lr = a->optimizer == KT_OPTIM_SGD ? 0.1f : 1e-3f;
    int rc = check_contradictions(a);
    if (rc != 0)
        return rc;
    const tool_path paths[] = {{"the program", a->program, 0}, {"--data", a->data, 0},
                               {"--params", a->params, 0},     {"--experts", a->experts, 0},
                               {"--eval-data", a->eval_data, 0},
                               {"--save", a->save, 1},         {"--losses", a->losses, 1}};
    return tool_check_paths("kt-train", paths, sizeof paths / sizeof paths[0]);
}

/* ---- setup and teardown ------------------------------------------------------------------ */

static int writes_save(const trainer *t);

/* Whether the run splits experts over the ranks (--moe-parallel ep, or a moe op's). */
static int uses_ep(const trainer *t, const train_args *a)
{
    if (t->r.world < 2 || a->moe_parallel == KT_MOE_PARALLEL_ALL_RANK0)
        return 0;
    for (int i = 0; i < kt_program_moe_count(t->p); i++) {
        kt_program_moe info;
        if (a->moe_parallel == KT_MOE_PARALLEL_ALL_EP ||
            (kt_program_moe_info(t->p, i, &info) == KT_OK && info.parallel == KT_MOE_PARALLEL_EP))
            return 1;
    }
    return 0;
}

/* --params FILE: with expert parallelism rank r > 0 reads FILE.rank<r> where there is one (its
 * share as an expert-parallel --save wrote it); else FILE, from which each share takes its
 * experts by name (a one-rank run's file, say). */
static const char *params_shard(const trainer *t, const char *path, char *buf, size_t size)
{
    kt_st_file *f = NULL;
    if (t->r.rank == 0 || !writes_save(t) ||
        snprintf(buf, size, "%s.rank%d", path, t->r.rank) >= (int)size ||
        kt_st_open(buf, &f) != KT_OK) {
        kt_clear_error();
        return path;
    }
    kt_st_close(f);
    return buf;
}

static int create_session(trainer *t, const train_args *a)
{
    kt_session_options so = {.pool = t->pool,
                             .seed = a->seed,
                             .optimizer = {.kind = a->optimizer,
                                           .lr = a->lr,
                                           .momentum = a->momentum,
                                           .beta1 = a->beta1,
                                           .beta2 = a->beta2,
                                           .weight_decay = a->weight_decay,
                                           .clip_norm = a->clip,
                                           .schedule = a->schedule,
                                           .warmup_steps = a->warmup,
                                           .total_steps = a->steps,
                                           .min_lr = a->min_lr},
                             .micro_batches = (int)a->accum,
                             .moe_parallel = a->moe_parallel,
                             .moe_layers = t->moe.layers,
                             .n_moe_layers = t->moe.n,
                             .comm = t->r.comm};
    if (kt_session_create(t->p, &so, &t->s) != KT_OK)
        return train_fail("cannot create the session", kt_last_error());
    char shard[4096];
    const char *from = a->params != NULL ? params_shard(t, a->params, shard, sizeof shard) : NULL;
    if (from != NULL && kt_session_load(t->s, from, KT_LOAD_ALLOW_INITIALISED) != KT_OK)
        return train_fail("cannot load the parameters", kt_last_error());
    return 0;
}

static void print_summary(const trainer *t, const train_args *a)
{
    kt_program_stats st;
    kt_program_get_stats(t->p, &st);
    int64_t per_rank = t->data.window / t->r.world;
    static const char *const schedules[] = {"constant", "cosine", "linear"};
    printf("kt-train: %s: %d rank%s, %lld tokens per window (%lld per rank) x %lld per step, "
           "%lld parameter bytes, %s lr %g %s", a->program, t->r.world,
           t->r.world == 1 ? "" : "s", (long long)t->data.window, (long long)per_rank,
           (long long)a->accum, (long long)st.param_bytes,
           a->optimizer == KT_OPTIM_ADAMW ? "adamw" : "sgd", (double)a->lr,
           schedules[a->schedule]);
    if (a->warmup > 0)
        printf(" warm-up %lld", (long long)a->warmup);
    if (a->schedule != KT_LR_CONSTANT)
        printf(" to %g", (double)a->min_lr);
    printf(", weight decay %g, clip %g\n", (double)a->weight_decay, (double)a->clip);
    const kt_moe_config *c = moe_first_config(&t->moe); /* rank 0 holds the layers */
    if (c != NULL) {
        static const char *const modes[] = {"frozen", "lora", "full"};
        printf("kt-train: %d MoE layer%s (E=%lld, k=%lld, H=%lld, I=%lld, %s%s, %s", t->moe.n_ops,
               t->moe.n_ops == 1 ? "" : "s", (long long)c->n_experts, (long long)c->top_k,
               (long long)c->hidden, (long long)c->intermediate,
               c->quant ? kt_moe_quant_name(c->quant) : kt_dtype_name(c->weight_dtype),
               c->quant == KT_MOE_QUANT_INT4 ? (c->quant_group == 32    ? " g32"
                                                : c->quant_group == 128 ? " g128"
                                                                        : " g64")
                                             : "",
               modes[c->mode]);
        if (c->mode == KT_MOE_LORA)
            printf(" r=%lld alpha=%g", (long long)c->lora_rank, (double)c->lora_alpha);
        printf(")%s", t->r.world > 1 ? ", experts on rank 0" : "");
        if (t->moe.n_recompute > 0) /* the checkpoint pass's choice */
            printf(", %d recomputing gate/up in backward (checkpointed)", t->moe.n_recompute);
        uint64_t held, raw;
        moe_store_bytes(&t->moe, &held, &raw);
        printf(", experts %.1f MB", (double)held / 1e6);
        if (c->quant)
            printf(" (%.3f of bf16's %.1f MB)", (double)held / (double)raw, (double)raw / 1e6);
        printf("\n");
    }
    printf("kt-train: data %s: %lld tokens\n", a->data, (long long)t->data.n_tokens);
    if (t->eval.path != NULL) {
        char text[128];
        eval_describe(t, t->baseline_nats, text, sizeof text);
        printf("kt-train: held-out %s: %lld windows; unigram baseline %s\n", a->eval_data,
               (long long)t->eval_windows, text);
    }
    if (t->resumed)
        printf("kt-train: resumed from %s at step %lld\n", t->from.dir,
               (long long)t->first_step);
    int later = t->resumed ? run_dir_later_checkpoints(t, t->first_step) : 0;
    if (later > 0)
        printf("kt-train: note: %s holds %d checkpoint%s after step %lld, from the run before "
               "this resume: the first checkpoint this run writes replaces %s\n", t->run_dir,
               later, later == 1 ? "" : "s", (long long)t->first_step,
               later == 1 ? "it" : "them");
    fflush(stdout);
}

/* The initial parameters, in program order (they come from --params or --seed) */
static uint64_t params_hash(const trainer *t)
{
    uint64_t h = HASH_START;
    for (int i = 0; i < kt_program_count(t->p, KT_ROLE_PARAM); i++) {
        const char *name = NULL;
        kt_tensor v;
        if (kt_program_tensor_info(t->p, KT_ROLE_PARAM, i, &name, NULL) == KT_OK &&
            kt_session_tensor(t->s, KT_ROLE_PARAM, name, &v) == KT_OK)
            h = hash_bytes(h, v.data, kt_tensor_nbytes(&v));
    }
    return h;
}

/* Every rank must run the same training: kt-launch gives them the same arguments, but ranks
 * started by hand or by another launcher may differ in an option that changes the numbers
 * (a learning rate, a seed, a step count), which nothing else would notice. Each rank's
 * values are gathered and compared with rank 0's before the first step. */
static int check_same_run(const trainer *t, const train_args *a)
{
    enum { N = 17 };
    static const char *const names[N] = {
        "--steps", "--seed", "--lr", "--optimizer", "--moe-inter", "--moe-dtype",
        "--moe-mode / --moe-parallel", "--lora-rank", "--lora-alpha",
        "--data-format", "--data-header", "the data file's token count",
        "the data file's contents",
        "the program's tokens per step", "--input-tokens / --input-labels / --input-targets",
        "the initial parameters (--params, --seed)",
        "training settings (--accum, --schedule, --warmup, --clip, --weight-decay, ...)"};
    uint32_t lr_bits, alpha_bits;
    memcpy(&lr_bits, &a->lr, sizeof lr_bits);
    memcpy(&alpha_bits, &a->lora_alpha, sizeof alpha_bits);
    uint64_t names_hash = hash_bytes(HASH_START, a->tokens_input,
                                     strlen(a->tokens_input) + 1);
    names_hash = hash_bytes(names_hash, a->targets_input, strlen(a->targets_input) + 1);
    names_hash = hash_bytes(names_hash, a->labels_input, strlen(a->labels_input) + 1);
    const uint64_t own[N] = {(uint64_t)a->steps, a->seed, lr_bits, (uint64_t)a->optimizer,
                             (uint64_t)a->moe_inter,
                             (uint64_t)a->moe_dtype | (uint64_t)a->moe_quant << 8 |
                                 (uint64_t)a->moe_group << 16,
                             (uint64_t)a->moe_mode | (uint64_t)a->moe_parallel << 8,
                             (uint64_t)a->lora_rank, alpha_bits,
                             (uint64_t)a->token_bytes,
                             (uint64_t)a->data_header, (uint64_t)t->data.n_tokens,
                             t->data.content_hash,
                             (uint64_t)t->data.window, names_hash, params_hash(t),
                             resume_settings_hash(t, a)};
    uint64_t *all = malloc(sizeof own * (size_t)t->r.world);
    if (all == NULL)
        return train_fail("out of memory", NULL);
    int rc = 0;
    if (kt_comm_all_gather(t->r.comm, own, sizeof own, all) != KT_OK)
        rc = train_fail("cannot compare the ranks' options", kt_last_error());
    for (int r = 1; r < t->r.world && rc == 0; r++)
        for (int k = 0; k < N && rc == 0; k++)
            if (all[r * N + k] != all[k])
                rc = train_error("rank %d's %s differs from rank 0's: every rank must be started "
                                 "with the same options and files", r, names[k]);
    free(all);
    return rc;
}

/* Whether the file holds experts of the program's moe ops: kt-train's own save (the
 * metadata) or a checkpoint with the first expert of one of them under the op's names. */
static int holds_experts(const kt_st_file *f, const kt_program *p)
{
    int holds = kt_st_metadata(f, "kt.moe_layers") != NULL;
    for (int i = 0; i < kt_program_moe_count(p) && !holds; i++) {
        kt_program_moe info;
        char name[512];
        kt_tensor view;
        holds = kt_program_moe_info(p, i, &info) == KT_OK &&
                kt_moe_tensor_name(info.names, info.binding, 0, KT_MOE_GATE, "weight", name,
                                   sizeof name) == KT_OK &&
                kt_st_find(f, name, &view) == KT_OK;
    }
    kt_clear_error();
    return holds;
}

/* Before any memory is committed: rank 0's output files can be written, the --params and
 * --experts files open as safetensors (a file of no bytes, or not one, is refused), and they
 * do not both bring experts. */
static int check_weight_files(const train_args *a, const ranks *r, const kt_program *p)
{
    const char *outputs[2][2] = {{"--save", a->save}, {"--losses", a->losses}};
    for (int k = 0; k < 2 && r->rank == 0; k++) {
        kt_out_file *probe = NULL; /* opened and discarded: the target is not touched */
        if (outputs[k][1] != NULL && kt_out_open(outputs[k][1], &probe) != KT_OK)
            return train_error("cannot write %s: %s", outputs[k][0], kt_last_error());
        kt_out_discard(probe);
    }
    int params_has_experts = 0;
    const char *paths[2] = {a->params, a->experts}, *what[2] = {"parameters", "experts"};
    for (int k = 0; k < 2; k++) {
        kt_st_file *f;
        if (paths[k] == NULL)
            continue;
        if (kt_st_open(paths[k], &f) != KT_OK) {
            train_error("cannot read the %s: %s", what[k], kt_last_error());
            return 1;
        }
        if (k == 0)
            params_has_experts = holds_experts(f, p);
        kt_st_close(f);
    }
    if (params_has_experts && a->experts != NULL)
        return train_error("--params %s holds the experts already (kt-train --save wrote it, or "
                           "a checkpoint under the moe ops' names): leave out --experts %s",
                           a->params, a->experts);
    return 0;
}

/* What the session and the MoE layers will commit, against what the machine can give: a run
 * that cannot fit stops here, in well under a second, with nothing allocated. */
static int check_memory(const trainer *t, const train_args *a)
{
    const kt_session_options so = {.optimizer = {.kind = a->optimizer}};
    const int states = a->optimizer == KT_OPTIM_ADAMW ? 2 : 0;
    uint64_t session = 0, experts = 0, avail = 0;
    if (kt_session_memory_bytes(t->p, &so, &session) != KT_OK ||
        moe_memory_need(a, t->p, &t->r, states, &experts) != 0)
        return train_fail("cannot size the run's memory", kt_last_error());
    if (kt_memory_available(&avail) != KT_OK)
        return train_fail("cannot read the memory available", kt_last_error());
    if (session + experts <= avail)
        return 0;
    char total[32], plan[32], moe[32], have[32];
    return train_error("%s needs %s of memory (%s for the program's memory plan, %s for the "
                       "MoE experts), but %s is available: nothing was allocated", a->program,
                       kt_format_bytes(session + experts, total, sizeof total),
                       kt_format_bytes(session, plan, sizeof plan),
                       kt_format_bytes(experts, moe, sizeof moe),
                       kt_format_bytes(avail, have, sizeof have));
}

/* --resume: the checkpoint, and the program it holds when none is given. */
static int find_resume(trainer *t, train_args *a)
{
    if (a->resume == NULL)
        return 0;
    if (checkpoint_find(a->resume, &t->from) != 0)
        return 1;
    t->resumed = 1;
    if (a->program == NULL)
        a->program = t->from.program;
    return 0;
}

/* Everything before the first step. Every argument and input file is checked, and the whole
 * run's memory admitted, before anything large is allocated. The parts that differ between
 * ranks (rank 0's MoE layers and the sessions that bind them, rank 0's run directory) are
 * agreed on, so that no rank starts training while another has failed; the rest fails the
 * same way on every rank. */
static int setup(trainer *t, train_args *a)
{
    t->last_eval = NAN;
    t->run_dir_lock = -1;
    if (ranks_open(&t->r) != 0 || find_resume(t, a) != 0 || program_open(t, a) != 0)
        return 1;
    t->run_dir = a->run_dir != NULL ? a->run_dir : t->resumed ? t->from.run_dir : NULL;
    int rc = data_open(&t->data, a->data, a, t->p, &t->r);
    if (rc == 0 && a->eval_data != NULL)
        rc = eval_open(t, a);
    if (rc == 0)
        rc = check_weight_files(a, &t->r, t->p);
    if (rc == 0)
        rc = check_memory(t, a);
    if (rc == 0 && kt_threadpool_create(a->threads, &t->pool) != KT_OK)
        rc = train_fail("cannot start the thread pool", kt_last_error());
    if (rc == 0 && t->resumed)
        rc = resume_check(t, a, &t->from);
    if (rc == 0)
        rc = run_dir_open(t);
    if (rc == 0 && (a->run_dir != NULL || a->resume != NULL) && uses_ep(t, a))
        /* every rank sees the same options and program: all stop, none waits */
        rc = train_error("--run-dir / --resume with expert parallelism: the run directory's "
                         "checkpoints are rank 0's alone and would miss the other ranks' "
                         "experts; use --save and --params (FILE.rank<r>)");
    if (rc == 0)
        rc = moe_setup(&t->moe, a, t->p, &t->r, t->pool);
    if (rc == 0)
        rc = create_session(t, a);
    if (rc == 0 && t->resumed && (rc = resume_load(t)) == 0)
        t->first_step = t->from.step;
    if (rc == 0)
        rc = data_bind(&t->data, t->s);
    if (rc == 0 && t->eval.path != NULL)
        rc = data_bind(&t->eval, t->s);
    if (rc == 0 && t->r.rank == 0 && a->losses != NULL &&
        kt_out_open(a->losses, &t->losses) != KT_OK)
        rc = train_fail("cannot create the losses file", kt_last_error());
    if (ranks_agree(&t->r, rc == 0 ? KT_OK : KT_EINVAL) != KT_OK) {
        if (rc == 0) /* another rank failed and has said why; say where this one stopped */
            train_error("rank %d: stopping: %s", t->r.rank, kt_last_error());
        return 1;
    }
    if (t->r.world > 1 && check_same_run(t, a) != 0)
        return 1;
    if (t->r.rank == 0)
        print_summary(t, a);
    return 0;
}

/* One file, written whole or not at all: the parameters, the experts and the optimizer state
 * never come from two different saves. */
static int save(trainer *t, const train_args *a)
{
    /* expert parallelism: rank r > 0 writes its share to FILE.rank<r> (with the replicated
     * parameters and its optimizer state); the files together hold every expert */
    char path[4096];
    if (t->r.rank > 0 &&
        snprintf(path, sizeof path, "%s.rank%d", a->save, t->r.rank) >= (int)sizeof path)
        return train_error("--save %s: the name is too long", a->save);
    const char *to = t->r.rank > 0 ? path : a->save;
    if (kt_session_save(t->s, to, 1) != KT_OK)
        return train_fail("cannot save", kt_last_error());
    if (t->r.rank == 0)
        printf("kt-train: saved the parameters%s and the optimizer state to %s\n",
               t->moe.n_ops > 0 ? ", the experts" : "", a->save);
    return 0;
}

/* Whether this rank writes a file at the end: rank 0, and every rank holding an
 * expert-parallel share. */
static int writes_save(const trainer *t)
{
    if (t->r.rank == 0)
        return 1;
    for (int b = 0; b < t->moe.n; b++)
        if (t->moe.layers[b] != NULL)
            return 1;
    return 0;
}

/* The run's result against the bar it had to pass. */
static void print_result(const trainer *t)
{
    if (t->eval.path == NULL || isnan(t->last_eval))
        return;
    double bytes = data_bytes_per_token(&t->eval);
    printf("held-out loss %.4f", t->last_eval);
    if (bytes > 0)
        printf(" = %.4f bits/byte", t->last_eval / log(2.0) / bytes);
    else
        printf(" (perplexity %.4g)", exp(t->last_eval));
    if (t->baseline_nats > 0)
        printf(", %.3f of the unigram baseline (%.4f%s)", t->last_eval / t->baseline_nats,
               bytes > 0 ? t->baseline_nats / log(2.0) / bytes : t->baseline_nats,
               bytes > 0 ? " bits/byte" : " nats");
    printf("\n");
}

static void teardown(trainer *t)
{
    data_close(&t->data);
    if (t->eval.path != NULL)
        data_close(&t->eval);
    kt_session_destroy(t->s);
    kt_moe_layers_destroy(&t->moe);
    kt_threadpool_destroy(t->pool);
    kt_program_destroy(t->p);
    free(t->program_bytes);
    run_dir_close(t);
    ranks_close(&t->r); /* last: it waits for every rank */
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    static train_args a; /* static: the -D names it holds live as long as the process */
    int rc = parse_args(argc, argv, &a);
    if (rc != 0)
        return rc < 0 ? tool_finish_stdout("kt-train") : rc;
    if (kt_check_environment() != KT_OK)
        return usage_error("%s", kt_last_error());
    static trainer t;
    memset(&t, 0, sizeof t);
    stop_install(); /* a signal during setup stops after the first step */
    rc = setup(&t, &a);
    int stopped = 0;
    if (rc == 0)
        rc = train_loop(&t, &a, &stopped);
    else
        kt_out_discard(t.losses);
    if (rc == 0 && stopped == 0) {
        /* rank 0 writes the files; the others wait for it and learn whether it could */
        kt_status saved = KT_OK;
        if (a.save != NULL && writes_save(&t) && save(&t, &a) != 0)
            saved = KT_EIO;
        if (ranks_agree(&t.r, saved) != KT_OK) { /* rank 0's save, or a rank not there */
            if (t.r.comm != NULL)
                train_error("rank %d stops: %s", t.r.rank, kt_last_error());
            rc = 1;
        }
    }
    double peak = tool_peak_rss_mb();
    if (rc == 0 && t.r.rank == 0) {
        print_result(&t);
        if (peak >= 0)
            printf("peak RSS %.1f MB\n", peak);
    }
    teardown(&t);
    int out = tool_finish_stdout("kt-train");
    /* a signal that came after the last step (during the last evaluation or save, which it
     * let finish) still ends the process by it, so that a calling script stops too */
    int sig = stopped != 0 ? stopped : stop_signal();
    if (rc == 0 && sig != 0)
        stop_exit(sig);
    return rc != 0 ? rc : out;
}
