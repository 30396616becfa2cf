// Counter-based random numbers, as autograd-core's `uniform(seed, counter)` (random.rs): number
// `counter` of stream `seed` is `counter_mix(counter_mix(seed ^ golden) + counter)`, whose top 24
// bits are the uniform's. Shared by the dropout kernel (index.cu) and attention's dropout
// (attention.cuh), so every mask is the CPU's bit for bit.

#pragma once

#define COUNTER_GOLDEN 0x9E3779B97F4A7C15ULL

// The splitmix64 finaliser.
__device__ __forceinline__ unsigned long long counter_mix(unsigned long long z) {
    z += COUNTER_GOLDEN;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// The base of stream `seed`: number `counter` is `counter_mix(counter_stream(seed) + counter)`.
__device__ __forceinline__ unsigned long long counter_stream(unsigned long long seed) {
    return counter_mix(seed ^ COUNTER_GOLDEN);
}

// The 24 random bits of number `counter` of the stream whose base is `stream`.
__device__ __forceinline__ unsigned int counter_bits24(unsigned long long stream, unsigned long long counter) {
    return (unsigned int)(counter_mix(stream + counter) >> 40);
}
