/* Disentangled attention as an ONNX Runtime custom operator: disentangled::Attention runs position_bias.h's attend()
   (float32, the position terms made inside the tile, the bias never written) on ONNX Runtime's own threads.

       out_i = sum_j softmax_j(scale q_i . k_j + q_i . Kr[c(i - j)] + k_j . Qr[c(i - j)]) v_j   over the kept keys

   Inputs (float32 unless said):
     0 query, 1 key, 2 value   [B, L, H * 64], the heads side by side (the projections' own layout)
     3 pos_key                  Kr, rows reversed, in native.as_key_tiles' layout [H, W / 16, 64, 16]; optional
     4 pos_query                Qr in the same layout; optional (one of the two at least)
     5 column, 6 c2p_column     int32 [2L - 1], native.kernel_columns'
     7 keep                     uint8 [B, L], 1 = a key to attend to; optional (every key)
   Attributes: scale (float), heads (int).
   Output: [B, L, H * 64]. A sequence with no key to attend to attends uniformly to every key, as PyTorch's eager
   attention does under a mask of the dtype's minimum; L = 0 is an empty output; a NaN reaches the output as in
   PyTorch's attention.

   The graph is not trusted: before any kernel work, every shape is checked, and every value the kernel indexes with
   against position_bias.h's contract (the columns inside [0, W), ascending by at most one column per distance,
   c2p_column column's mirror). A violation is an INVALID_ARGUMENT error naming the input, the entry and
   the rule (SECURITY.md says how this is tested).

   Versions: the node's `version` attribute names the operator version the graph was written for (absent: 1, the
   graphs written before it); a library of another version refuses the graph when the session is made, naming both,
   so that a graph never runs on a library that would compute something else. OPERATOR_VERSION changes with any
   change of the inputs, attributes or what they mean (ort_operator.OPERATOR_VERSION says the same).

   Built by ort_operator.py once per instruction set, this file and the kernels it includes (modeling/position_bias.h,
   found by -I) one unit, with -DORT_UNIT=register_<set>: the unit's RegisterCustomOps takes that name and the
   kernels' entries are local to the unit, so that the units of several sets share one library whose ort_dispatch.c
   chooses among them. No OpenMP: the operator runs on ONNX Runtime's threads (the kernels' pragmas are then
   ignored). Built alone (no ORT_UNIT), this file defines RegisterCustomOps for the set its flags name.
   ONNX Runtime's C API is reached through the OrtApiBase it hands RegisterCustomOps: a table of function pointers
   whose order ONNX Runtime never changes (new functions are appended), so the few used here are called by their
   place in the table (API_*, checked against onnxruntime_c_api.h of API version 29; each exists from version 17 on,
   which is the version asked for). OrtCustomOp is declared here in the same order as ONNX Runtime's; its version
   (16) tells ONNX Runtime which fields it may read. */

#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* sched_getaffinity */
#endif
#ifdef ORT_UNIT
#define ENTRY static __attribute__((unused)) /* position_bias.h's entries: this unit's own */
/* built without OpenMP: its pragmas are ignored, and the thread counts only they read are unused */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunknown-pragmas"
#pragma GCC diagnostic ignored "-Wunused-parameter"
#endif
#include "position_bias.h"
#ifdef ORT_UNIT
#pragma GCC diagnostic pop
#endif

#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>

typedef struct OrtStatus OrtStatus;
typedef void OrtValue, OrtKernelContext, OrtKernelInfo, OrtShapeInfo, OrtDomain, OrtSessionOptions;

/* The entries of ONNX Runtime's OrtApi used here, by their place in the table. */
enum {
    API_CREATE_STATUS = 0,
    API_CREATE_CUSTOM_OP_DOMAIN = 26,
    API_CUSTOM_OP_DOMAIN_ADD = 27,
    API_ADD_CUSTOM_OP_DOMAIN = 28,
    API_GET_TENSOR_MUTABLE_DATA = 51,
    API_GET_DIMENSIONS_COUNT = 61,
    API_GET_DIMENSIONS = 62,
    API_GET_TENSOR_TYPE_AND_SHAPE = 65,
    API_KERNEL_INFO_GET_ATTRIBUTE_FLOAT = 85,
    API_KERNEL_INFO_GET_ATTRIBUTE_INT64 = 86,
    API_KERNEL_CONTEXT_GET_INPUT = 90,
    API_KERNEL_CONTEXT_GET_OUTPUT = 91,
    API_RELEASE_STATUS = 93,
    API_RELEASE_TENSOR_TYPE_AND_SHAPE_INFO = 99,
    API_KERNEL_CONTEXT_PARALLEL_FOR = 274,
};
#define API_VERSION 17 /* ONNX Runtime 1.17: the first with KernelContext_ParallelFor */
#define OPERATOR_VERSION 1

/* ONNXTensorElementDataType, OrtErrorCode, OrtCustomOpInputOutputCharacteristic: the values used here */
enum { TYPE_FLOAT = 1, TYPE_UINT8 = 2, TYPE_INT32 = 6 };
enum { ERROR_FAIL = 1, ERROR_INVALID_ARGUMENT = 2 };
enum { REQUIRED = 0, OPTIONAL = 1 };

typedef void *ApiEntry;
typedef struct {
    const ApiEntry *(*get_api)(uint32_t version);
    const char *(*get_version_string)(void);
} ApiBase;

typedef struct CustomOp CustomOp;
struct CustomOp { /* OrtCustomOp, field for field */
    uint32_t version;
    void *(*create_kernel)(const CustomOp *, const ApiEntry *, const OrtKernelInfo *);
    const char *(*get_name)(const CustomOp *);
    const char *(*get_execution_provider_type)(const CustomOp *);
    int (*get_input_type)(const CustomOp *, size_t);
    size_t (*get_input_type_count)(const CustomOp *);
    int (*get_output_type)(const CustomOp *, size_t);
    size_t (*get_output_type_count)(const CustomOp *);
    void (*kernel_compute)(void *, OrtKernelContext *);
    void (*kernel_destroy)(void *);
    int (*get_input_characteristic)(const CustomOp *, size_t);
    int (*get_output_characteristic)(const CustomOp *, size_t);
    int (*get_input_memory_type)(const CustomOp *, size_t);
    int (*get_variadic_input_min_arity)(const CustomOp *);
    int (*get_variadic_input_homogeneity)(const CustomOp *);
    int (*get_variadic_output_min_arity)(const CustomOp *);
    int (*get_variadic_output_homogeneity)(const CustomOp *);
    OrtStatus *(*create_kernel_v2)(const CustomOp *, const ApiEntry *, const OrtKernelInfo *, void **);
    OrtStatus *(*kernel_compute_v2)(void *, OrtKernelContext *);
    OrtStatus *(*infer_output_shape)(const CustomOp *, OrtShapeInfo *);
    int (*get_start_version)(const CustomOp *);
    int (*get_end_version)(const CustomOp *);
    size_t (*get_may_inplace)(int **, int **);
    void (*release_may_inplace)(int *, int *);
    size_t (*get_alias_map)(int **, int **);
    void (*release_alias_map)(int *, int *);
};

static const ApiEntry *api; /* ONNX Runtime's table, from RegisterCustomOps */

#define CALL(index, type) ((type)api[index])
typedef OrtStatus *(*CreateStatusFn)(int, const char *);
typedef void (*ReleaseFn)(void *);

static OrtStatus *fail(int code, const char *message) { return CALL(API_CREATE_STATUS, CreateStatusFn)(code, message); }

/* ---- The kernel: its attributes, read once ---- */

typedef struct {
    float scale;
    int64_t heads;
} Kernel;

static OrtStatus *create_kernel(const CustomOp *op, const ApiEntry *given, const OrtKernelInfo *info, void **out) {
    (void)op, (void)given;
    Kernel *kernel = calloc(1, sizeof(Kernel));
    if (kernel == NULL) return fail(ERROR_FAIL, "disentangled::Attention: out of memory");
    OrtStatus *status = CALL(API_KERNEL_INFO_GET_ATTRIBUTE_FLOAT, OrtStatus * (*)(const void *, const char *, float *))(
        info, "scale", &kernel->scale);
    if (status == NULL)
        status = CALL(API_KERNEL_INFO_GET_ATTRIBUTE_INT64, OrtStatus * (*)(const void *, const char *, int64_t *))(
            info, "heads", &kernel->heads);
    if (status == NULL && (kernel->heads < 1 || kernel->heads > INT32_MAX / DIM))
        status = fail(ERROR_INVALID_ARGUMENT, "disentangled::Attention: the heads attribute must lie in [1, 2^31 / 64)");
    int64_t version = 1;
    if (status == NULL) {
        OrtStatus *absent = CALL(API_KERNEL_INFO_GET_ATTRIBUTE_INT64,
                                 OrtStatus * (*)(const void *, const char *, int64_t *))(info, "version", &version);
        if (absent != NULL) CALL(API_RELEASE_STATUS, ReleaseFn)(absent), version = 1; /* a graph from before it */
    }
    if (status == NULL && version != OPERATOR_VERSION) {
        char message[512];
        snprintf(message, sizeof(message),
                 "disentangled::Attention: the graph was written for version %lld of the operator, and this library "
                 "runs version %d. Load the library that disentangled export-onnx --kernel wrote beside the graph, "
                 "or export the graph again with the package that built this library",
                 (long long)version, OPERATOR_VERSION);
        status = fail(ERROR_INVALID_ARGUMENT, message);
    }
    if (status != NULL) {
        free(kernel);
        return status;
    }
    *out = kernel;
    return NULL;
}

static void destroy_kernel(void *kernel) { free(kernel); }

/* An input's data and shape: NULL data for an absent optional input; rank > 8 is refused. */
typedef struct {
    void *data;
    int64_t shape[8];
    size_t rank;
} Input;

static OrtStatus *read_input(OrtKernelContext *context, size_t index, Input *input) {
    const OrtValue *value = NULL;
    input->data = NULL, input->rank = 0;
    OrtStatus *status = CALL(API_KERNEL_CONTEXT_GET_INPUT, OrtStatus * (*)(const void *, size_t, const OrtValue **))(
        context, index, &value);
    if (status != NULL || value == NULL) return status;
    void *info = NULL;
    status = CALL(API_GET_TENSOR_TYPE_AND_SHAPE, OrtStatus * (*)(const OrtValue *, void **))(value, &info);
    if (status != NULL) return status;
    status = CALL(API_GET_DIMENSIONS_COUNT, OrtStatus * (*)(const void *, size_t *))(info, &input->rank);
    if (status == NULL && input->rank > 8) status = fail(ERROR_INVALID_ARGUMENT, "disentangled::Attention: rank > 8");
    if (status == NULL)
        status = CALL(API_GET_DIMENSIONS, OrtStatus * (*)(const void *, int64_t *, size_t))(info, input->shape,
                                                                                              input->rank);
    CALL(API_RELEASE_TENSOR_TYPE_AND_SHAPE_INFO, ReleaseFn)(info);
    if (status == NULL)
        status = CALL(API_GET_TENSOR_MUTABLE_DATA, OrtStatus * (*)(const OrtValue *, void **))(value, &input->data);
    return status;
}

/* ---- Workspaces: one per thread running an item at once, kept for the next call ----

   ONNX Runtime hands each item to whichever of its threads is free and says not which thread that is, so an item
   takes a free workspace from a pool shared by every node and session of the process (a lock-free claim of a slot),
   grows it if the call needs more, and gives it back. The pool holds at most as many workspaces as items ever ran at
   once (the threads that run the operator), each as large as the longest input seen: a session of one thread keeps
   one, whatever the number of processors. */

#define SLOTS 512
typedef struct {
    atomic_int busy;
    char *buffer;
    int64_t bytes;
} Slot;
static Slot slots[SLOTS];

static Slot *claim(int64_t bytes) {
    for (int i = 0; i < SLOTS; i++) {
        int expected = 0;
        if (!atomic_load_explicit(&slots[i].busy, memory_order_relaxed) &&
            atomic_compare_exchange_strong(&slots[i].busy, &expected, 1)) {
            Slot *slot = &slots[i];
            if (slot->bytes < bytes) {
                free(slot->buffer);
                slot->buffer = aligned_alloc(64, (size_t)bytes);
                slot->bytes = slot->buffer ? bytes : 0;
            }
            if (slot->buffer) return slot;
            atomic_store(&slot->busy, 0);
            return NULL;
        }
    }
    return NULL; /* more than SLOTS items at once */
}

/* ---- One call: attend()'s items on ONNX Runtime's threads ---- */

typedef struct {
    AttendArgs args;
    int64_t chunks, bytes;
    atomic_int failed; /* 1: no vector set; 2: no memory for a workspace; 3: the kernel's contract refused */
} Call;

static void run_item(void *data, size_t item) {
    Call *call = data;
    Slot *slot = claim(call->bytes);
    if (slot == NULL) {
        atomic_store(&call->failed, 2);
        return;
    }
    const int refused = attend_part(&call->args, call->chunks, (int64_t)item, (int64_t)item + 1, slot->buffer);
    if (refused) atomic_store(&call->failed, refused == COLUMNS_REFUSED ? 3 : 1);
    atomic_store(&slot->busy, 0);
}

/* The processors this process may run on. */
static int64_t usable_cpus(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
    return 1;
}

/* position_bias.h's contract (rule 1) for the graph's two column vectors, before any kernel work: they come from
   the ONNX file, which this operator trusts no more than any other input. An error names the input, the entry, its
   value and the rule it breaks. */
static OrtStatus *columns_refused_here(const int32_t *column, const int32_t *c2p_column, int64_t count, int64_t width) {
    const int32_t *vectors[2] = {column, c2p_column};
    static const char *names[2] = {"column (input 5)", "c2p_column (input 6)"};
    int64_t at = -1;
    for (int v = 0; v < 2; v++) {
        int fault = column_fault(vectors[v], count, width, 1, &at);
        if (v == 1 && fault == COLUMN_HOLDS) fault = mirror_fault(column, c2p_column, count, &at);
        if (fault == COLUMN_HOLDS) continue;
        char message[512];
        snprintf(message, sizeof(message),
                 "disentangled::Attention: %s, entry %lld (value %d, W = %lld): %s; export the graph again with "
                 "disentangled export-onnx --kernel, which writes them from the model's buckets",
                 names[v], (long long)at, vectors[v][at], (long long)width, column_rule(fault));
        return fail(ERROR_INVALID_ARGUMENT, message);
    }
    return NULL;
}

static OrtStatus *compute(void *state, OrtKernelContext *context) {
    const Kernel *kernel = state;
    Input in[8];
    OrtStatus *status = NULL;
    for (size_t i = 0; i < 8; i++) {
        status = read_input(context, i, &in[i]);
        if (status != NULL) return status;
    }
    const Input *query = &in[0], *key = &in[1], *value = &in[2], *pos_key = &in[3], *pos_query = &in[4];
    const Input *keep = &in[7];
    const int64_t heads = kernel->heads;
    if (query->rank != 3 || query->shape[2] != heads * DIM)
        return fail(ERROR_INVALID_ARGUMENT, "disentangled::Attention: query must be [B, L, heads * 64]");
    const int64_t batch = query->shape[0], length = query->shape[1], hidden = query->shape[2];
    for (int i = 1; i < 3; i++)
        if (in[i].rank != 3 || in[i].shape[0] != batch || in[i].shape[1] != length || in[i].shape[2] != hidden)
            return fail(ERROR_INVALID_ARGUMENT, "disentangled::Attention: key and value must have the query's shape");
    const Input *table = pos_key->data ? pos_key : pos_query;
    if (table->data == NULL)
        return fail(ERROR_INVALID_ARGUMENT, "disentangled::Attention: give pos_key or pos_query (or both)");
    for (int i = 3; i < 5; i++)
        if (in[i].data && (in[i].rank != 4 || in[i].shape[0] != heads || in[i].shape[1] != table->shape[1] ||
                           in[i].shape[1] < 1 || in[i].shape[2] != DIM || in[i].shape[3] != 16))
            return fail(ERROR_INVALID_ARGUMENT, "disentangled::Attention: pos_key and pos_query must be "
                                                "[heads, W / 16, 64, 16] with W >= 16 (native.as_key_tiles)");
    const int64_t width = table->shape[1] * 16;
    if (length > INT32_MAX / 2)
        return fail(ERROR_INVALID_ARGUMENT, "disentangled::Attention: at most 2^30 tokens (the int32 columns)");
    const int64_t count = length > 0 ? 2 * length - 1 : 0;
    for (int i = 5; i < 7; i++)
        if (in[i].rank != 1 || in[i].shape[0] != count)
            return fail(ERROR_INVALID_ARGUMENT, "disentangled::Attention: column and c2p_column must be [2L - 1] "
                                                "([0] when L is 0)");
    if (keep->data && (keep->rank != 2 || keep->shape[0] != batch || keep->shape[1] != length))
        return fail(ERROR_INVALID_ARGUMENT, "disentangled::Attention: keep must be [B, L]");
    status = columns_refused_here(in[5].data, in[6].data, count, width);
    if (status != NULL) return status;

    int64_t out_shape[3] = {batch, length, hidden};
    OrtValue *output = NULL;
    void *out = NULL;
    status = CALL(API_KERNEL_CONTEXT_GET_OUTPUT,
                             OrtStatus * (*)(void *, size_t, const int64_t *, size_t, OrtValue **))(context, 0, out_shape,
                                                                                                   3, &output);
    if (status == NULL) status = CALL(API_GET_TENSOR_MUTABLE_DATA, OrtStatus * (*)(OrtValue *, void **))(output, &out);
    if (status != NULL) return status;
    if (batch == 0 || length == 0) return NULL;

    const int64_t row = hidden, sequence_stride = length * hidden;
    Call call = {
        .args =
            {
                .query = query->data,
                .key = key->data,
                .value = value->data,
                .query_sequence = sequence_stride, .query_head = DIM, .query_row = row,
                .key_sequence = sequence_stride, .key_head = DIM, .key_row = row,
                .value_sequence = sequence_stride, .value_head = DIM, .value_row = row,
                .out = out,
                .out_sequence = sequence_stride, .out_head = DIM, .out_row = row,
                .pos_key = pos_key->data,
                .pos_query = pos_query->data,
                .width = width,
                .column = in[5].data,
                .c2p_column = in[6].data,
                .keep = keep->data,
                .keep_sequence = keep->data ? length : 0,
                .heads = heads,
                .length = length,
                .first_key = 0,
                .keys = length,
                .scale = kernel->scale,
            },
    };
    /* as native.attend: where the planes are fewer than the processors, each plane's rows in parts */
    const int64_t planes = batch * heads, cpus = usable_cpus();
    call.chunks = planes < cpus ? (cpus + planes - 1) / planes : 1;
    call.bytes = (workspace_bytes(length, width) + 63) / 64 * 64;
    status = CALL(API_KERNEL_CONTEXT_PARALLEL_FOR,
                  OrtStatus * (*)(const void *, void (*)(void *, size_t), size_t, size_t, void *))(
        context, run_item, (size_t)(planes * call.chunks), 0, &call);
    if (status != NULL) return status;
    if (atomic_load(&call.failed) == 2)
        return fail(ERROR_FAIL, "disentangled::Attention: out of memory for the workspace");
    if (atomic_load(&call.failed) == 1)
        return fail(ERROR_FAIL, "disentangled::Attention: the kernel was built without a vector set");
    if (atomic_load(&call.failed) == 3)
        return fail(ERROR_INVALID_ARGUMENT, "disentangled::Attention: the kernel refused its arguments (position_bias.h's "
                                            "contract)");

    /* a sequence with no key kept: every row the mean of the values, as eager attention under the dtype's minimum */
    for (int64_t b = 0; keep->data && b < batch; b++) {
        const uint8_t *kept = (const uint8_t *)keep->data + b * length;
        int64_t any = 0;
        for (int64_t j = 0; j < length && !any; j++) any = kept[j];
        if (any) continue;
        float *rows = (float *)out + b * sequence_stride;
        const float *values = (const float *)value->data + b * sequence_stride;
        for (int64_t c = 0; c < hidden; c++) {
            double sum = 0;
            for (int64_t j = 0; j < length; j++) sum += values[j * hidden + c];
            rows[c] = (float)(sum / (double)length);
        }
        for (int64_t i = 1; i < length; i++) memcpy(rows + i * hidden, rows, (size_t)hidden * sizeof(float));
    }
    return NULL;
}

/* ---- The operator's description ---- */

static const char *op_name(const CustomOp *op) { return (void)op, "Attention"; }
static const char *op_provider(const CustomOp *op) { return (void)op, "CPUExecutionProvider"; }
static size_t input_count(const CustomOp *op) { return (void)op, 8; }
static size_t output_count(const CustomOp *op) { return (void)op, 1; }
static int input_type(const CustomOp *op, size_t index) {
    (void)op;
    return index == 5 || index == 6 ? TYPE_INT32 : index == 7 ? TYPE_UINT8 : TYPE_FLOAT;
}
static int output_type(const CustomOp *op, size_t index) { return (void)op, (void)index, TYPE_FLOAT; }
static int input_characteristic(const CustomOp *op, size_t index) {
    (void)op;
    return index == 3 || index == 4 || index == 7 ? OPTIONAL : REQUIRED;
}
static int output_characteristic(const CustomOp *op, size_t index) { return (void)op, (void)index, REQUIRED; }
static int memory_type(const CustomOp *op, size_t index) { return (void)op, (void)index, 0; /* the default */ }

static const CustomOp attention_op = {
    .version = 16, /* 16: CreateKernelV2 and KernelComputeV2; nothing past them is read */
    .get_name = op_name,
    .get_execution_provider_type = op_provider,
    .get_input_type = input_type,
    .get_input_type_count = input_count,
    .get_output_type = output_type,
    .get_output_type_count = output_count,
    .kernel_destroy = destroy_kernel,
    .get_input_characteristic = input_characteristic,
    .get_output_characteristic = output_characteristic,
    .get_input_memory_type = memory_type,
    .create_kernel_v2 = create_kernel,
    .kernel_compute_v2 = compute,
};

/* ONNX Runtime calls this when a session's options load the library (register_custom_ops_library); in a unit of
   the library for several sets, ort_dispatch.c's RegisterCustomOps calls it by the unit's name. */
#ifdef ORT_UNIT
#define REGISTER ORT_UNIT
__attribute__((visibility("hidden"))) OrtStatus *REGISTER(OrtSessionOptions *options, const ApiBase *base);
#else
#define REGISTER RegisterCustomOps
#endif
OrtStatus *REGISTER(OrtSessionOptions *options, const ApiBase *base) {
    api = base->get_api(API_VERSION);
    if (api == NULL) return NULL; /* older than 1.17: nothing can be reported through the table; see ort_version */
    if (!strcmp(instruction_set(), "none"))
        return fail(ERROR_FAIL, "disentangled::Attention: the kernel was built without a vector set");
    OrtDomain *domain = NULL; /* kept for the life of the process, as ONNX Runtime needs it past the session */
    OrtStatus *status = CALL(API_CREATE_CUSTOM_OP_DOMAIN, OrtStatus * (*)(const char *, OrtDomain **))("disentangled",
                                                                                                        &domain);
    if (status == NULL) status = CALL(API_CUSTOM_OP_DOMAIN_ADD, OrtStatus * (*)(OrtDomain *, const CustomOp *))(
        domain, &attention_op);
    if (status == NULL)
        status = CALL(API_ADD_CUSTOM_OP_DOMAIN, OrtStatus * (*)(OrtSessionOptions *, OrtDomain *))(options, domain);
    return status;
}
