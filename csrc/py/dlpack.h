/* dlpack.h - the DLPack ABI (version 1.x) that dpmini produces and consumes.
 *
 * Written for dpmini from the published DLPack specification; the layouts
 * and enum values below are the ABI and must not change. Python side (the
 * DLPack Python specification): a producer's __dlpack__ returns a PyCapsule
 * named "dltensor" (holding a DLManagedTensor, legacy) or "dltensor_versioned"
 * (holding a DLManagedTensorVersioned, when the consumer passed
 * max_version >= (1, 0)). A consumer that takes ownership renames the capsule
 * to "used_dltensor" / "used_dltensor_versioned" and later calls the deleter
 * itself; the capsule's destructor calls the deleter only when the capsule
 * was never consumed.
 */
#ifndef DPMINI_DLPACK_H
#define DPMINI_DLPACK_H

#include <stdint.h>

/* The version dpmini's producer reports in DLManagedTensorVersioned. */
#define DP_DLPACK_MAJOR 1
#define DP_DLPACK_MINOR 1

/* A major version change breaks the ABI; minor versions only add. */
typedef struct {
    uint32_t major;
    uint32_t minor;
} DLPackVersion;

/* Where the memory is. Only kDLCPU, kDLCUDA, kDLCUDAHost and kDLCUDAManaged
 * matter to dpmini; the others are listed so their values are known. */
typedef enum {
    kDLCPU = 1,          /* ordinary host memory                         */
    kDLCUDA = 2,         /* CUDA device memory                           */
    kDLCUDAHost = 3,     /* page-locked host memory (cudaMallocHost)     */
    kDLOpenCL = 4,
    kDLVulkan = 7,
    kDLMetal = 8,
    kDLVPI = 9,
    kDLROCM = 10,
    kDLROCMHost = 11,
    kDLExtDev = 12,
    kDLCUDAManaged = 13, /* cudaMallocManaged memory                     */
    kDLOneAPI = 14,
    kDLWebGPU = 15,
    kDLHexagon = 16,
    kDLMAIA = 17,
} DLDeviceType;

typedef struct {
    DLDeviceType device_type;
    int32_t device_id;   /* the device ordinal (CUDA device index)        */
} DLDevice;

/* Type codes of DLDataType.code. */
typedef enum {
    kDLInt = 0U,
    kDLUInt = 1U,
    kDLFloat = 2U,
    kDLOpaqueHandle = 3U,
    kDLBfloat = 4U,
    kDLComplex = 5U,     /* bits is the whole complex (64 = two float32)  */
    kDLBool = 6U,        /* bits 8: one byte per bool                     */
    /* DLPack 1.1: the small floats (bits 8; 6 and 4 for the last three,
     * packed unless the IS_SUBBYTE_TYPE_PADDED flag is set) */
    kDLFloat8_e3m4 = 7U,
    kDLFloat8_e4m3 = 8U,
    kDLFloat8_e4m3b11fnuz = 9U,
    kDLFloat8_e4m3fn = 10U,
    kDLFloat8_e4m3fnuz = 11U,
    kDLFloat8_e5m2 = 12U,
    kDLFloat8_e5m2fnuz = 13U,
    kDLFloat8_e8m0fnu = 14U,
    kDLFloat6_e2m3fn = 15U,
    kDLFloat6_e3m2fn = 16U,
    kDLFloat4_e2m1fn = 17U,
} DLDataTypeCode;

typedef struct {
    uint8_t code;        /* a DLDataTypeCode                              */
    uint8_t bits;        /* bits per lane                                 */
    uint16_t lanes;      /* 1 for every dtype dpmini accepts              */
} DLDataType;

/* A strided view. Owned by whoever owns the enclosing managed tensor. */
typedef struct {
    void *data;          /* base pointer; on kDLCUDA a device pointer      */
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;      /* ndim entries, elements; never NULL if ndim > 0 */
    int64_t *strides;    /* ndim entries, in ELEMENTS (not bytes); NULL
                            means C-contiguous (allowed for legacy only;
                            versioned producers should fill it)           */
    uint64_t byte_offset;/* bytes from data to element (0, ..., 0)         */
} DLTensor;

/* Legacy managed tensor (capsule "dltensor"). */
typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;   /* the producer's; opaque to the consumer        */
    /* Called once by the owner (consumer, or the unconsumed capsule's
     * destructor) to release everything; may be NULL. */
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

/* Bits of DLManagedTensorVersioned.flags. */
#define DLPACK_FLAG_BITMASK_READ_ONLY (1UL << 0UL)  /* must not be written  */
#define DLPACK_FLAG_BITMASK_IS_COPIED (1UL << 1UL)  /* a fresh copy: the
                                                       consumer may own it  */
#define DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED (1UL << 2UL)

/* Versioned managed tensor (capsule "dltensor_versioned"). Note the field
 * order differs from the legacy struct: version first, dl_tensor last, so
 * that future versions can grow the struct. */
typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

#endif
