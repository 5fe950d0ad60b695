/* libFuzzer target: the .ktg model-description parser.
 *
 * Parses the input (not NUL-terminated) with a small -D override; when it parses, compiles
 * the graph for training when it has a loss, else forward only. Any input must give a graph
 * or diagnostics, never a crash, hang or leak. */
#include <stddef.h>
#include <stdint.h>

#include "kt/kt.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static char diag[16384];
    kt_graph *g = NULL;
    int n_errors = 0;
    if (kt_ktg_parse((const char *)data, size, "fuzz.ktg", NULL, 0, &g, diag, sizeof diag,
                     &n_errors) != KT_OK)
        return 0;
    /* compiling is quadratic in places (the memory plan): big graphs are the parser's
     * business here, not the planner's, so only small ones are compiled */
    if (kt_graph_node_count(g) > 512) {
        kt_graph_destroy(g);
        return 0;
    }
    kt_program *p = NULL;
    kt_compile_options opt = {.training = 1};
    if (kt_compile(g, &opt, &p) != KT_OK) {
        opt.training = 0;
        (void)kt_compile(g, &opt, &p);
    }
    kt_program_destroy(p);
    kt_graph_destroy(g);
    return 0;
}
