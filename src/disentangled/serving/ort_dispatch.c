/* The entry of the operator library for every processor of a machine kind: ort_attention.c is compiled once per
   instruction set into units of one library (ort_operator.py: x86-64's AVX-512 and AVX2 units, aarch64's NEON
   unit), and RegisterCustomOps here hands ONNX Runtime's call to the unit this processor runs, read from its own
   flags (CPUID, through the compiler's __builtin_cpu_supports), never from the machine that built the library.

   This file is compiled for the machine's baseline (no vector flags): loading the library and choosing run on any
   processor of its kind. A processor with neither set gets an ONNX Runtime error naming what it lacks, not an
   illegal instruction. DISENTANGLED_CPU_ISA=avx2 (or avx512, neon) asks for a set by name, as for the PyTorch
   kernels: a lower one, to test or time it on a processor that has a higher; a set the processor lacks is an error.

   Besides RegisterCustomOps the library answers two questions without ONNX Runtime (for ctypes, ort_operator.py):
   disentangled_operator_version(), the version of disentangled::Attention it runs, and
   disentangled_instruction_set(), the set RegisterCustomOps would choose now ("none: why" where it would refuse). */

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct OrtStatus OrtStatus;
typedef void OrtSessionOptions;
typedef void *ApiEntry;
typedef struct {
    const ApiEntry *(*get_api)(uint32_t version);
    const char *(*get_version_string)(void);
} ApiBase;

#define OPERATOR_VERSION 1 /* ort_attention.c's, which each unit checks a graph against */
#define API_VERSION 17
#define API_CREATE_STATUS 0
#define ERROR_FAIL 1

/* Each unit's RegisterCustomOps, renamed by -DORT_UNIT (ort_attention.c). */
#define UNIT(name) __attribute__((visibility("hidden"))) OrtStatus *register_##name(OrtSessionOptions *, const ApiBase *);

typedef struct {
    const char *name;
    OrtStatus *(*register_unit)(OrtSessionOptions *, const ApiBase *);
    int runs; /* whether this processor runs the unit's instructions */
} Set;

#if defined(__x86_64__)
UNIT(avx512)
UNIT(avx2)
#define LACKING "AVX-512 (F, BW, VL) and AVX2 + FMA"
static int sets(Set *out) {
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    /* the AVX-512 unit is built with -mavx512f -mavx512bw -mavx512vl -mavx2 -mfma: each is asked for */
    const int avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl");
    out[0] = (Set){"avx512", register_avx512, avx512};
    out[1] = (Set){"avx2", register_avx2, avx2};
    return 2;
}
#elif defined(__aarch64__)
UNIT(neon)
#define LACKING "NEON"
static int sets(Set *out) {
    out[0] = (Set){"neon", register_neon, 1}; /* Advanced SIMD: part of every aarch64 processor Linux runs on */
    return 1;
}
#else
#error "the operator library is built for x86-64 and aarch64"
#endif

/* The unit to run, or one with no name, the reason in `why` (nothing static: sessions may be made on many threads). */
static Set choose(char *why, size_t size) {
    Set all[4];
    const int count = sets(all);
    const char *asked = getenv("DISENTANGLED_CPU_ISA");
    if (asked != NULL && *asked != '\0') {
        for (int i = 0; i < count; i++) {
            if (strcmp(asked, all[i].name) != 0) continue;
            if (all[i].runs) return all[i];
            snprintf(why, size, "DISENTANGLED_CPU_ISA=%s asks for a set this processor does not run", asked);
            return (Set){0};
        }
        snprintf(why, size, "DISENTANGLED_CPU_ISA=%s names no set of this library (it has", asked);
        for (int i = 0; i < count; i++) snprintf(why + strlen(why), size - strlen(why), " %s", all[i].name);
        snprintf(why + strlen(why), size - strlen(why), "); unset it for the best this processor runs");
        return (Set){0};
    }
    for (int i = 0; i < count; i++)
        if (all[i].runs) return all[i];
    snprintf(why, size, "this processor has neither of " LACKING ", the instruction sets the kernel is built for");
    return (Set){0};
}

int disentangled_operator_version(void) { return OPERATOR_VERSION; }

/* For a diagnosis from one thread (ctypes): the answer of the last call. */
const char *disentangled_instruction_set(void) {
    static char answer[320] = "none: ";
    const Set set = choose(answer + 6, sizeof(answer) - 6);
    return set.name != NULL ? set.name : answer;
}

OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const ApiBase *base) {
    char why[256], message[384];
    const Set set = choose(why, sizeof(why));
    if (set.name != NULL) return set.register_unit(options, base);
    const ApiEntry *api = base->get_api(API_VERSION);
    if (api == NULL) return NULL; /* older than 1.17: nothing can be reported through the table */
    snprintf(message, sizeof(message), "disentangled::Attention cannot run here: %s", why);
    return ((OrtStatus * (*)(int, const char *)) api[API_CREATE_STATUS])(ERROR_FAIL, message);
}
