/* A small driver of modeling/position_bias.c's kernels, for tests/test_kernel_driver.py: it runs the kernel calls a
   PyTorch test recorded, on the inputs it wrote, and compares each call's outputs with the expected ones it wrote.
   Built for aarch64 (run under qemu-aarch64) and natively for each x86 vector set, so that the NEON build is
   checked without ARM hardware and every set runs the same cases.

   The case file, little-endian (the recording and the targets are all 64-bit little-endian, with the same struct
   layouts: every field is 8 bytes but AttendArgs' scale, which is 4 bytes and 4 of padding on both):

       "DKD1"
       int64 arrays;  per array: int64 bytes, then its bytes (a tensor's whole storage)
       int64 calls;   per call:
           int64 kernel (0 position_bias, 1 hankel_bias, 2 hankel_bias_backward, 3 attend, 4 keep_mask)
           int64 element_size, planes, chunks (attend), threads
           int64 struct bytes, then the argument struct as native.py built it, its pointers zero
           int64 pointers; per pointer: int64 offset in the struct, array, byte offset in the array (-1: NULL)
           int64 checks;   per check: int64 array, int64 element (4 float32, 2 bfloat16, 1 uint8), double tolerance,
                           int64 offset, int64 bytes, then the expected bytes of the array from that offset

   attend's workspace is the driver's own (workspace_bytes per thread). Prints one line per call and exits 1 if any
   output differs from the expected by more than its tolerance (NaN matches NaN), 2 on a malformed file. */

#include "../modeling/position_bias.c"

#include <stdio.h>

static FILE *in;

static void fail(const char *what) {
    fprintf(stderr, "kernel_driver: %s\n", what);
    exit(2);
}

static int64_t read64(void) {
    int64_t value;
    if (fread(&value, 8, 1, in) != 1) fail("the case file ends early");
    return value;
}

/* `count` bytes from the file, in an allocation of exactly that size (64-byte aligned, as PyTorch's storages are),
   so that a read or write one byte past an array is outside it (the sanitizer build of .ci/run reports it). */
static void *read_bytes(int64_t count) {
    if (count < 0 || count > ((int64_t)1 << 34)) fail("a size out of range");
    void *bytes = NULL;
    if (posix_memalign(&bytes, 64, (size_t)(count ? count : 1))) fail("out of memory");
    if (count && fread(bytes, 1, (size_t)count, in) != (size_t)count) fail("the case file ends early");
    return bytes;
}

static float as_float(const char *data, int64_t index, int64_t element) {
    if (element == 1) return ((const uint8_t *)data)[index];
    if (element == 2) return from_bf16(((const uint16_t *)data)[index]);
    return ((const float *)data)[index];
}

int main(int argc, char **argv) {
    if (argc != 2) fail("usage: kernel_driver CASES");
    in = fopen(argv[1], "rb");
    if (in == NULL) fail("cannot open the case file");
    char magic[4];
    if (fread(magic, 1, 4, in) != 4 || memcmp(magic, "DKD1", 4) != 0) fail("not a case file");
    const int64_t count = read64();
    char **arrays = calloc((size_t)count, sizeof(char *));
    int64_t *sizes = calloc((size_t)count, sizeof(int64_t));
    for (int64_t a = 0; a < count; a++) {
        sizes[a] = read64();
        arrays[a] = read_bytes(sizes[a]);
    }
    static const char *names[] = {"position_bias", "hankel_bias", "hankel_bias_backward", "attend", "keep_mask"};
    static const size_t struct_sizes[] = {sizeof(BiasArgs), sizeof(HankelArgs), sizeof(HankelArgs), sizeof(AttendArgs),
                                          sizeof(KeepArgs)};
    const int64_t calls = read64();
    int failed = 0;
    printf("instruction set %s, %lld calls\n", instruction_set(), (long long)calls);
    for (int64_t c = 0; c < calls; c++) {
        const int64_t kernel = read64(), element_size = read64(), planes = read64(), chunks = read64();
        const int threads = (int)read64();
        if (kernel < 0 || kernel > 4) fail("an unknown kernel");
        const int64_t size = read64();
        if (size != (int64_t)struct_sizes[kernel]) fail("the argument struct's size differs from this build's");
        char *args = read_bytes(size);
        const int64_t pointers = read64();
        for (int64_t p = 0; p < pointers; p++) {
            const int64_t offset = read64(), array = read64(), at = read64();
            if (offset < 0 || offset + 8 > size || array < -1 || array >= count) fail("a pointer out of range");
            void *pointer = array < 0 ? NULL : arrays[array] + at;
            memcpy(args + offset, &pointer, sizeof(pointer));
        }
        void *workspace = NULL;
        int status;
        if (kernel == 0) status = position_bias((const BiasArgs *)args, element_size, planes, threads);
        else if (kernel == 1) status = hankel_bias((const HankelArgs *)args, element_size, planes, threads);
        else if (kernel == 2) status = hankel_bias_backward((const HankelArgs *)args, element_size, planes, threads);
        else if (kernel == 4) status = keep_mask((const KeepArgs *)args, threads);
        else {
            AttendArgs *x = (AttendArgs *)args;
            if (posix_memalign(&workspace, 64, (size_t)(threads * workspace_bytes(x->keys, x->width))))
                fail("out of memory");
            x->workspace = workspace;
            status = attend(x, element_size, planes, chunks, threads);
        }
        double worst = 0.0, allowed = 0.0;
        const int64_t checks = read64();
        int ok = status == 0;
        for (int64_t k = 0; k < checks; k++) {
            const int64_t array = read64(), element = read64();
            double tolerance;
            if (fread(&tolerance, 8, 1, in) != 1) fail("the case file ends early");
            const int64_t offset = read64(), bytes = read64();
            if (array < 0 || array >= count || (element != 1 && element != 2 && element != 4) || offset < 0 || offset % element ||
                bytes % element || offset + bytes > sizes[array])
                fail("a check out of range");
            char *expected = read_bytes(bytes), *actual = arrays[array] + offset;
            for (int64_t i = 0; i < bytes / element; i++) {
                const float want = as_float(expected, i, element), got = as_float(actual, i, element);
                if (memcmp(expected + i * element, actual + i * element, (size_t)element) == 0) continue;
                if (isnan(want) && isnan(got)) continue;
                const double off = isnan(want) || isnan(got) ? INFINITY : fabs((double)got - (double)want);
                worst = off > worst ? off : worst;
                if (off > tolerance) ok = 0;
            }
            allowed = tolerance > allowed ? tolerance : allowed;
            free(expected);
        }
        printf("call %lld %s (%s): status %d, largest difference %.3g, tolerance %.3g: %s\n", (long long)c,
               names[kernel], element_size == 2 ? "bfloat16" : element_size == 1 ? "uint8" : "float32", status, worst, allowed, ok ? "ok" : "FAILED");
        failed |= !ok;
        free(workspace);
        free(args);
    }
    for (int64_t a = 0; a < count; a++) free(arrays[a]);
    free(arrays);
    free(sizes);
    fclose(in);
    return failed;
}
