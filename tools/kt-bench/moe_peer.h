/* kt-bench moe's PyTorch peer as a process that times one call at a time on request
 * (moe_torch_peer.py), so that its calls and libkt's alternate and both are measured
 * in the same minutes of this VM, whose speed drifts by the minute. */
#ifndef KT_BENCH_MOE_PEER_H
#define KT_BENCH_MOE_PEER_H

#include <stddef.h>
#include <stdint.h>

typedef struct moe_peer moe_peer;

/* Starts `python3 script inputs --mode MODE --dtype DTYPE --threads N --rotate R
 * --shift S` and waits until it has loaded its inputs (at most 10 minutes). Returns NULL with
 * a one-line reason in note when it cannot run (no torch: the script exits 77). */
moe_peer *moe_peer_start(const char *script, const char *inputs, const char *mode,
                         const char *dtype, int threads, int rotate, int64_t shift, char *note,
                         size_t note_size);

/* Any peer script on the same protocol: runs `python args...` (python: a path, or a name
 * looked up in PATH; args[0] the script), waits as moe_peer_start does, and copies the peer's
 * {"ready": ...} line into ready (NULL: not wanted). label names the peer in notes
 * ("torch sdpa f32" -> "torch sdpa f32 peer did not run (exit 77): ..."). */
moe_peer *bench_peer_start(const char *python, const char *const *args, int n_args,
                           const char *label, char *ready, size_t ready_size, char *note,
                           size_t note_size);

/* One call (forward, or forward+backward) on the ids of call `call`; its time in ms, or -1
 * with a reason in note when the peer failed or gave no answer in 5 minutes (it is then
 * killed, and not asked again). */
double moe_peer_call(moe_peer *p, int backward, int call, char *note, size_t note_size);

/* Whether p failed (or is NULL) */
int moe_peer_failed(const moe_peer *p);

/* Waits MOE_PEER_GAP_MS: between one process's calls and the other's, so that neither
 * starts while the other's threads still spin (PyTorch's OpenMP threads spin a few ms after
 * a parallel region; libkt's pool less). */
#define MOE_PEER_GAP_MS 20
void moe_peer_gap(void);

/* Asks the peer to quit and waits for it (killed after 10 s); NULL is fine. */
void moe_peer_stop(moe_peer *p);

#endif
