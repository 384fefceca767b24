"""Probe (issue 68.8): what slows the training steps while the pinned buffers are reserved on a thread of their own.
A launch-bound GPU loop (many small kernels and some bf16 matmuls, as a ZeRO-3 step) runs in the main thread while
another thread prepares 8 GiB of host memory: registered in one call, in 256 MiB pieces, only faulted in, or
faulted in then registered, allocated pinned by torch (cudaHostAlloc), or private huge pages populated by
madvise then registered (thp+one), or that as 1024 buffers of 8 MiB (many: ZeRO-2 reserves one per
parameter).  PROBE=one,touch+one picks.  Prints the loop's time against the loop alone, alternated."""
import ctypes, mmap, os, threading, time, torch

libc = ctypes.CDLL(None, use_errno=True)

GIB = 8
PIECE = 256 << 20
cudart = torch.cuda.cudart()
a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
small = [torch.randn(4096, device="cuda") for _ in range(64)]


def loop(n=60):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n):
        x = a
        for _ in range(8):
            x = x @ a
        for s in small:
            s.mul_(0.999).add_(0.001)
    torch.cuda.synchronize(); return time.perf_counter() - t0


def prepare(how, done):
    t0 = time.perf_counter()
    if how == "hostalloc":
        buf = torch.empty(GIB << 30, dtype=torch.uint8, pin_memory=True).untyped_storage()
        done.append(time.perf_counter() - t0)
        return buf
    if how == "many":  # the same bytes as 1024 buffers of 8 MiB, each backed and registered (ZeRO-2's parameters)
        bufs = []
        for _ in range((GIB << 30) // (8 << 20)):
            region = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE)
            buf = torch.frombuffer(region, dtype=torch.uint8).untyped_storage()
            if libc.madvise(ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(buf.nbytes()), 23):
                torch.empty(0, dtype=torch.uint8).set_(buf).zero_()
            assert int(cudart.cudaHostRegister(buf.data_ptr(), buf.nbytes(), 1)) == 0
            bufs.append(buf)
        done.append(time.perf_counter() - t0)
        return bufs
    if how.startswith("thp"):  # private anonymous pages, huge where the kernel gives them, populated by madvise
        region = mmap.mmap(-1, GIB << 30, flags=mmap.MAP_PRIVATE)
        buf = torch.frombuffer(region, dtype=torch.uint8).untyped_storage()
        libc.madvise(ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(buf.nbytes()), 14)  # MADV_HUGEPAGE
        if libc.madvise(ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(buf.nbytes()), 23):  # MADV_POPULATE_WRITE
            torch.empty(0, dtype=torch.uint8).set_(buf).zero_()
        assert int(cudart.cudaHostRegister(buf.data_ptr(), buf.nbytes(), 1)) == 0
        done.append(time.perf_counter() - t0)
        return buf
    buf = torch.UntypedStorage(GIB << 30)
    if how in ("touch", "touch+one"):
        torch.empty(0, dtype=torch.uint8).set_(buf).zero_()
    if how in ("one", "touch+one"):
        assert int(cudart.cudaHostRegister(buf.data_ptr(), buf.nbytes(), 1)) == 0
    if how == "pieces":
        for off in range(0, buf.nbytes(), PIECE):
            assert int(cudart.cudaHostRegister(buf.data_ptr() + off, min(PIECE, buf.nbytes() - off), 1)) == 0
            time.sleep(0.001)
    done.append(time.perf_counter() - t0)
    return buf


N = int(200 * 3.0 / loop(200))  # about 3 s alone


def loop_n():
    return loop(N)


alone = [loop_n()]
for rnd in range(1):
    for how in os.environ.get("PROBE", "one,pieces,touch,touch+one,hostalloc,thp+one").split(","):
        done, holder = [], []
        t = threading.Thread(target=lambda: holder.append(prepare(how, done)))
        t.start(); took = loop_n(); t.join()
        buf = holder[0]
        if how in ("one", "touch+one", "thp+one"):
            cudart.cudaHostUnregister(buf.data_ptr())
        if how == "many":
            for piece in buf:
                cudart.cudaHostUnregister(piece.data_ptr())
        if how == "pieces":
            for off in range(0, buf.nbytes(), PIECE):
                cudart.cudaHostUnregister(buf.data_ptr() + off)
        del buf, holder
        alone.append(loop_n())
        print(f"round {rnd} {how:10s}: loop {took:.2f} s beside it (alone {alone[-1]:.2f} s); the {GIB} GiB took {done[0]:.2f} s", flush=True)
print("alone:", [round(x, 2) for x in alone])
