/*
 * cuda.h - the CUDA driver shim (cuda.c): plain C, no Python.h. Includes no
 * other header of ours.
 */
#ifndef TT_CUDA_H
#define TT_CUDA_H

#include <stddef.h>

/* The few driver types and entry points used here, declared by hand: their
 * ABI is fixed since CUDA 4 (the _v2 names since 4.0/7.0). */
typedef int TtCuResult; /* CUresult; 0 is CUDA_SUCCESS */
typedef int TtCuDevice;
typedef struct TtCuCtx *TtCuContext;
typedef struct TtCuStream *TtCuStream;
typedef struct TtCuGraphExec *TtCuGraphExec;
typedef struct TtCuEvent *TtCuEvent;
typedef unsigned long long TtCuDevicePtr;

#define TT_CU_EVENT_DISABLE_TIMING 0x2u

typedef struct TtCuda {
    int tried;        /* dlopen attempted */
    const char *error; /* static message when unusable; NULL when ready */
    void *lib;
    TtCuResult (*Init)(unsigned int);
    TtCuResult (*DeviceGet)(TtCuDevice *, int);
    TtCuResult (*DevicePrimaryCtxRetain)(TtCuContext *, TtCuDevice);
    TtCuResult (*DevicePrimaryCtxRelease)(TtCuDevice);
    TtCuResult (*CtxGetCurrent)(TtCuContext *);
    TtCuResult (*CtxPushCurrent)(TtCuContext);
    TtCuResult (*CtxPopCurrent)(TtCuContext *);
    TtCuResult (*MemcpyDtoDAsync)(TtCuDevicePtr, TtCuDevicePtr, size_t, TtCuStream);
    TtCuResult (*GraphLaunch)(TtCuGraphExec, TtCuStream);
    TtCuResult (*EventCreate)(TtCuEvent *, unsigned int);
    TtCuResult (*EventDestroy)(TtCuEvent);
    TtCuResult (*EventRecord)(TtCuEvent, TtCuStream);
    TtCuResult (*StreamWaitEvent)(TtCuStream, TtCuEvent, unsigned int);
    TtCuResult (*StreamSynchronize)(TtCuStream);
    TtCuResult (*GetErrorName)(TtCuResult, const char **);
    TtCuResult (*GetErrorString)(TtCuResult, const char **);
} TtCuda;

/* The driver's entry points once tt_cuda_load returned NULL; all NULL
 * before. Written only by tt_cuda_load, which the caller serialises (the
 * extension calls it with the GIL held). */
extern TtCuda tt_cuda;

/* Loads the driver the first time; NULL when it is ready, else a static
 * message saying why not (the same one on every later call). */
const char *tt_cuda_load(void);

/* The driver's name and description of `rc`; either NULL when unknown. */
void tt_cuda_describe(TtCuResult rc, const char **name, const char **text);

#endif /* TT_CUDA_H */
