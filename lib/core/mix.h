/* splitmix64's finaliser: a well-mixed 64-bit value from any 64-bit input, for deterministic
 * per-element random streams (parameter init, LoRA init). */
#ifndef KT_CORE_MIX_H
#define KT_CORE_MIX_H

#include <stdint.h>

static inline uint64_t kt__splitmix64(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

#endif
