"""Raises one real XID 31 on GPU 0: a kernel writes to address 0x10 and kills its own context (nothing else).
Prints T_INJECT (the launch) and T_ERR (the error seen), CLOCK_MONOTONIC nanoseconds."""
import time, cupy as cp
k = cp.RawKernel(r'extern "C" __global__ void f(){ *(volatile int*)0x10 = 1; }', 'f')
cp.cuda.Device(0).synchronize()
_ = k.kernel  # compile and load before the clock starts
print("T_INJECT", time.monotonic_ns(), flush=True)
k((1,), (1,), ())
try:
    cp.cuda.Device(0).synchronize()
except Exception as e:
    print("T_ERR", time.monotonic_ns(), type(e).__name__, str(e)[:120], flush=True)
