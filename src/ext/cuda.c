/*
 * cuda.c - the few CUDA driver calls the replay path makes, reached through
 * dlopen("libcuda.so.1") the first time they are needed, so the build needs
 * no CUDA headers and the package imports without a GPU. No Python here.
 */
#include "cuda.h"

#include <dlfcn.h>
#include <string.h>


/* Process-wide: the driver library is loaded once and never unloaded (torch
 * keeps it loaded too). */
TtCuda tt_cuda;

/* The first of `names` that the library exports, or NULL. */
static void *
tt_cuda_symbol(void *lib, const char *const *names)
{
    void *fn = NULL;

    for (; *names != NULL && fn == NULL; names++)
        fn = dlsym(lib, *names);
    return fn;
}

const char *
tt_cuda_load(void)
{
    static const char *const n_init[] = {"cuInit", NULL};
    static const char *const n_dev[] = {"cuDeviceGet", NULL};
    static const char *const n_retain[] = {"cuDevicePrimaryCtxRetain", NULL};
    static const char *const n_release[] = {"cuDevicePrimaryCtxRelease_v2",
                                            "cuDevicePrimaryCtxRelease", NULL};
    static const char *const n_getctx[] = {"cuCtxGetCurrent", NULL};
    static const char *const n_push[] = {"cuCtxPushCurrent_v2", "cuCtxPushCurrent", NULL};
    static const char *const n_pop[] = {"cuCtxPopCurrent_v2", "cuCtxPopCurrent", NULL};
    static const char *const n_copy[] = {"cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync", NULL};
    static const char *const n_launch[] = {"cuGraphLaunch", NULL};
    static const char *const n_evcreate[] = {"cuEventCreate", NULL};
    static const char *const n_evdestroy[] = {"cuEventDestroy_v2", "cuEventDestroy", NULL};
    static const char *const n_evrecord[] = {"cuEventRecord", NULL};
    static const char *const n_wait[] = {"cuStreamWaitEvent", NULL};
    static const char *const n_sync[] = {"cuStreamSynchronize", NULL};
    static const char *const n_errname[] = {"cuGetErrorName", NULL};
    static const char *const n_errstr[] = {"cuGetErrorString", NULL};
    TtCuda c;

    if (tt_cuda.tried)
        return tt_cuda.error;
    memset(&c, 0, sizeof(c));
    c.tried = 1;
    c.lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (c.lib == NULL) {
        c.error = "the CUDA driver (libcuda.so.1) could not be loaded";
        goto done;
    }
    *(void **)&c.Init = tt_cuda_symbol(c.lib, n_init);
    *(void **)&c.DeviceGet = tt_cuda_symbol(c.lib, n_dev);
    *(void **)&c.DevicePrimaryCtxRetain = tt_cuda_symbol(c.lib, n_retain);
    *(void **)&c.DevicePrimaryCtxRelease = tt_cuda_symbol(c.lib, n_release);
    *(void **)&c.CtxGetCurrent = tt_cuda_symbol(c.lib, n_getctx);
    *(void **)&c.CtxPushCurrent = tt_cuda_symbol(c.lib, n_push);
    *(void **)&c.CtxPopCurrent = tt_cuda_symbol(c.lib, n_pop);
    *(void **)&c.MemcpyDtoDAsync = tt_cuda_symbol(c.lib, n_copy);
    *(void **)&c.GraphLaunch = tt_cuda_symbol(c.lib, n_launch);
    *(void **)&c.EventCreate = tt_cuda_symbol(c.lib, n_evcreate);
    *(void **)&c.EventDestroy = tt_cuda_symbol(c.lib, n_evdestroy);
    *(void **)&c.EventRecord = tt_cuda_symbol(c.lib, n_evrecord);
    *(void **)&c.StreamWaitEvent = tt_cuda_symbol(c.lib, n_wait);
    *(void **)&c.StreamSynchronize = tt_cuda_symbol(c.lib, n_sync);
    *(void **)&c.GetErrorName = tt_cuda_symbol(c.lib, n_errname);
    *(void **)&c.GetErrorString = tt_cuda_symbol(c.lib, n_errstr);
    if (!c.Init || !c.DeviceGet || !c.DevicePrimaryCtxRetain || !c.DevicePrimaryCtxRelease ||
        !c.CtxGetCurrent || !c.CtxPushCurrent || !c.CtxPopCurrent || !c.MemcpyDtoDAsync ||
        !c.GraphLaunch || !c.EventCreate || !c.EventDestroy || !c.EventRecord ||
        !c.StreamWaitEvent || !c.StreamSynchronize || !c.GetErrorName || !c.GetErrorString) {
        c.error = "the CUDA driver (libcuda.so.1) lacks an entry point torch-tweak needs";
        dlclose(c.lib);
        c.lib = NULL;
        goto done;
    }
    if (c.Init(0) != 0) {
        c.error = "the CUDA driver failed to initialise (cuInit)";
        goto done;
    }
done:
    tt_cuda = c;
    return tt_cuda.error;
}

void
tt_cuda_describe(TtCuResult rc, const char **name, const char **text)
{
    *name = NULL;
    *text = NULL;
    if (tt_cuda.GetErrorName == NULL || tt_cuda.GetErrorName(rc, name) != 0)
        *name = NULL;
    if (tt_cuda.GetErrorString == NULL || tt_cuda.GetErrorString(rc, text) != 0)
        *text = NULL;
}
