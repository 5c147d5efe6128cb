// x86 SIMD intrinsics for the codec's paths that are compiled under target attributes and chosen
// at run time (compact_word_lanes.cpp, compact_block_simd.cpp), so the library still runs on
// CPUs without those instruction sets. DELTASYNC_X86_SIMD is 1 where the intrinsics exist.
// Include it only from such a .cpp: it silences, for the rest of the file, the warnings GCC 12
// gives inside its own AVX-512 headers (their _mm512_undefined_* placeholders) when the
// intrinsics are used under a target attribute rather than -mavx512f.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define DELTASYNC_X86_SIMD 1
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#endif
