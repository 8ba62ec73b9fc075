// The GC3 interpreter (GC3 paper §6.2, Figure 5), compiled at run time through
// NVRTC (CuPy RawModule) for the GPU in hand, and by nvcc -arch=sm_90 in CI.
//
// One CUDA block runs one slice of one IR thread block: the runtime may split
// every IR thread block into `split` CUDA blocks, block j handling slice j of
// every chunk. All instructions map chunk element e to chunk element e, so the
// slices are independent copies of the program (what MSCCL calls instances,
// done at launch time). Each slice is cut into tiles; the outer loop runs over
// tiles and the inner loop over the thread block's steps, so consecutive tiles
// pipeline through the connection FIFOs.
//
// Transport: a connection (sender rank, receiver rank, channel, slice) owns a
// FIFO of `nslots` slots in the receiver's memory, written by the sender over
// NVLink/P2P (push: the faster direction on H200, see the baseline notes).
//   Simple: the sender writes a slot, then releases `tail` (in the receiver's
//           memory) at system scope; the receiver acquires `tail`, reads.
//   LL:     16-byte lines {data0, flag, data1, flag}; the flag is the slot's
//           sequence number, so the receiver polls the line itself.
// Both: the receiver releases `head` (in the sender's memory) once a slot is
// consumed; the sender waits for head >= seq + 1 - nslots before reusing it.
// Sequence counters persist in device memory, so nothing is reset between
// calls and a CUDA graph can replay the launch.
//
// Cross-thread-block semaphores are monotonic 64-bit words: the high 32 bits
// are the call's epoch + 1 (persisted per block), the low 32 bits count
// (tile * nsteps + step + 1). A waiter compares with >=.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;

#define OP_SEND 0
#define OP_RECV 1
#define OP_RCS 2
#define OP_RRS 3
#define OP_RRC 4
#define OP_RRCS 5
#define OP_COPY 6
#define OP_REDUCE 7
#define OP_NOP 8

#define PROTO_SIMPLE 0
#define PROTO_LL 1

// Packed step: type, srcbuf, srcoff, dstbuf, dstoff, cnt, ndeps, dep_start, has_dep
#define STEP_FIELDS 9
#define MAX_THREADS 512
// Packed thread block: step_start, nsteps
#define TB_FIELDS 2

struct Conn {
  char* fifo;     // send: the peer's FIFO; recv: our FIFO
  u64* tail;      // send: the peer's tail word; recv: our tail word (Simple only)
  u64* head;      // send: our head word (written by the peer); recv: the peer's head word
  u64* counter;   // our persistent sequence counter for this direction of the connection
};

__device__ __forceinline__ u64 ld_acquire_sys(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(u64* p, u64 v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys(u64* p, u64 v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ u64 ld_acquire_gpu(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_gpu(u64* p, u64 v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint4 ld_ll(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_ll(uint4* p, u32 d0, u32 d1, u32 flag) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(d0), "r"(flag), "r"(d1),
               "r"(flag) : "memory");
}

// ---- element arithmetic (sum) ----
template <typename T> struct Arith;
template <> struct Arith<float> {
  static __device__ __forceinline__ float add(float a, float b) { return a + b; }
  static __device__ __forceinline__ u32 add2(u32 a, u32 b) {
    return __float_as_uint(__uint_as_float(a) + __uint_as_float(b));
  }
};
template <> struct Arith<__nv_bfloat16> {
  static __device__ __forceinline__ __nv_bfloat16 add(__nv_bfloat16 a, __nv_bfloat16 b) { return __hadd(a, b); }
  static __device__ __forceinline__ u32 add2(u32 a, u32 b) {
    __nv_bfloat162 x = *reinterpret_cast<__nv_bfloat162*>(&a), y = *reinterpret_cast<__nv_bfloat162*>(&b);
    __nv_bfloat162 z = __hadd2(x, y);
    return *reinterpret_cast<u32*>(&z);
  }
};
template <> struct Arith<__half> {
  static __device__ __forceinline__ __half add(__half a, __half b) { return __hadd(a, b); }
  static __device__ __forceinline__ u32 add2(u32 a, u32 b) {
    __half2 x = *reinterpret_cast<__half2*>(&a), y = *reinterpret_cast<__half2*>(&b);
    __half2 z = __hadd2(x, y);
    return *reinterpret_cast<u32*>(&z);
  }
};

template <typename T> __device__ __forceinline__ uint4 add16(uint4 a, uint4 b) {
  return make_uint4(Arith<T>::add2(a.x, b.x), Arith<T>::add2(a.y, b.y), Arith<T>::add2(a.z, b.z),
                    Arith<T>::add2(a.w, b.w));
}
template <typename T> __device__ __forceinline__ uint2 add8(uint2 a, uint2 b) {
  return make_uint2(Arith<T>::add2(a.x, b.x), Arith<T>::add2(a.y, b.y));
}

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<u64>(p) & 15) == 0; }
__device__ __forceinline__ bool aligned8(const void* p) { return (reinterpret_cast<u64>(p) & 7) == 0; }

// ---- Simple: one pass over n elements: v = a (+ b); o1 = v; o2 = v ----
// U 16-byte accesses per thread in flight (8 on the copy-only paths spills
// under the 128-register cap of 512-thread blocks: measured by ptxas, sm_90).
template <typename T, bool HB, bool HO1, bool HO2>
__device__ void pass_simple(const T* a, const T* b, T* o1, T* o2, i64 n) {
  constexpr int U = 4;
  const int tid = threadIdx.x, nt = blockDim.x;
  const int V = 16 / sizeof(T);
  bool vec = aligned16(a) && (!HB || aligned16(b)) && (!HO1 || aligned16(o1)) && (!HO2 || aligned16(o2));
  i64 nv = vec ? n / V : 0;
  const uint4* a4 = reinterpret_cast<const uint4*>(a);
  const uint4* b4 = reinterpret_cast<const uint4*>(b);
  uint4* o14 = reinterpret_cast<uint4*>(o1);
  uint4* o24 = reinterpret_cast<uint4*>(o2);
  for (i64 base = tid; base < nv; base += (i64)nt * U) {
    uint4 va[U], vb[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      i64 i = base + (i64)u * nt;
      if (i < nv) {
        va[u] = __ldcg(a4 + i);
        if (HB) vb[u] = __ldcg(b4 + i);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      i64 i = base + (i64)u * nt;
      if (i < nv) {
        uint4 v = HB ? add16<T>(va[u], vb[u]) : va[u];
        if (HO1) __stcg(o14 + i, v);
        if (HO2) __stcg(o24 + i, v);
      }
    }
  }
  for (i64 i = nv * V + tid; i < n; i += nt) {
    T v = a[i];
    if (HB) v = Arith<T>::add(v, b[i]);
    if (HO1) o1[i] = v;
    if (HO2) o2[i] = v;
  }
}

// ---- LL: 8 data bytes per 16-byte line ----
template <typename T> __device__ __forceinline__ uint2 load8(const T* p, i64 line, i64 n) {
  const int E = 8 / sizeof(T);
  i64 e0 = line * E;
  if (e0 + E <= n && aligned8(p)) return __ldcg(reinterpret_cast<const uint2*>(p) + line);
  union { uint2 u; T t[8 / sizeof(T)]; } r;
  r.u = make_uint2(0, 0);
#pragma unroll
  for (int k = 0; k < E; ++k)
    if (e0 + k < n) r.t[k] = p[e0 + k];
  return r.u;
}
template <typename T> __device__ __forceinline__ void store8(T* p, i64 line, i64 n, uint2 v) {
  const int E = 8 / sizeof(T);
  i64 e0 = line * E;
  if (e0 + E <= n && aligned8(p)) {
    __stcg(reinterpret_cast<uint2*>(p) + line, v);
    return;
  }
  union { uint2 u; T t[8 / sizeof(T)]; } r;
  r.u = v;
#pragma unroll
  for (int k = 0; k < E; ++k)
    if (e0 + k < n) p[e0 + k] = r.t[k];
}

// a from our LL FIFO (AF) or from a local buffer; o2 is the peer's LL FIFO.
// LL_U lines per thread per round: the local operand loads and the first poll of
// every line are issued before any flag is checked, so a thread waits about one
// latency per round instead of one per line.
#define LL_U 4
template <typename T, bool AF, bool HB, bool HO1, bool HO2>
__device__ void pass_ll(const T* a, const uint4* fin, u32 fin_flag, const T* b, T* o1, uint4* fout,
                        u32 fout_flag, i64 n) {
  const i64 nlines = (n * (i64)sizeof(T) + 7) / 8;
  const int nt = blockDim.x;
  for (i64 base = threadIdx.x; base < nlines; base += (i64)nt * LL_U) {
    uint2 v[LL_U], w[LL_U];
    uint4 line[LL_U];
#pragma unroll
    for (int u = 0; u < LL_U; ++u) {
      const i64 l = base + (i64)u * nt;
      if (l < nlines) {
        if (HB) w[u] = load8<T>(b, l, n);
        if (AF) line[u] = ld_ll(fin + l);
        else v[u] = load8<T>(a, l, n);
      }
    }
#pragma unroll
    for (int u = 0; u < LL_U; ++u) {
      const i64 l = base + (i64)u * nt;
      if (l < nlines) {
        if (AF) {
          while (line[u].y != fin_flag || line[u].w != fin_flag) line[u] = ld_ll(fin + l);
          v[u] = make_uint2(line[u].x, line[u].z);
        }
        if (HB) v[u] = add8<T>(v[u], w[u]);
        if (HO1) store8<T>(o1, l, n, v[u]);
        if (HO2) st_ll(fout + l, v[u].x, v[u].y, fout_flag);
      }
    }
  }
}

template <typename T>
__device__ void run_simple(int op, T* src, T* dst, T* fin, T* fout, i64 n) {
  switch (op) {
    case OP_SEND: pass_simple<T, false, false, true>(src, nullptr, nullptr, fout, n); break;
    case OP_RECV: pass_simple<T, false, true, false>(fin, nullptr, dst, nullptr, n); break;
    case OP_RCS: pass_simple<T, false, true, true>(fin, nullptr, dst, fout, n); break;
    case OP_RRS: pass_simple<T, true, false, true>(fin, src, nullptr, fout, n); break;
    case OP_RRC: pass_simple<T, true, true, false>(fin, src, dst, nullptr, n); break;
    case OP_RRCS: pass_simple<T, true, true, true>(fin, src, dst, fout, n); break;
    case OP_COPY: pass_simple<T, false, true, false>(src, nullptr, dst, nullptr, n); break;
    case OP_REDUCE: pass_simple<T, true, true, false>(src, dst, dst, nullptr, n); break;
    default: break;
  }
}

template <typename T>
__device__ void run_ll(int op, T* src, T* dst, const uint4* fin, u32 fin_flag, uint4* fout,
                       u32 fout_flag, i64 n) {
  switch (op) {
    case OP_SEND: pass_ll<T, false, false, false, true>(src, nullptr, 0, nullptr, nullptr, fout, fout_flag, n); break;
    case OP_RECV: pass_ll<T, true, false, true, false>(nullptr, fin, fin_flag, nullptr, dst, nullptr, 0, n); break;
    case OP_RCS: pass_ll<T, true, false, true, true>(nullptr, fin, fin_flag, nullptr, dst, fout, fout_flag, n); break;
    case OP_RRS: pass_ll<T, true, true, false, true>(nullptr, fin, fin_flag, src, nullptr, fout, fout_flag, n); break;
    case OP_RRC: pass_ll<T, true, true, true, false>(nullptr, fin, fin_flag, src, dst, nullptr, 0, n); break;
    case OP_RRCS: pass_ll<T, true, true, true, true>(nullptr, fin, fin_flag, src, dst, fout, fout_flag, n); break;
    default: break;
  }
}

__device__ __forceinline__ bool op_sends(int op) { return op == OP_SEND || op == OP_RCS || op == OP_RRS || op == OP_RRCS; }
__device__ __forceinline__ bool op_recvs(int op) {
  return op == OP_RECV || op == OP_RCS || op == OP_RRS || op == OP_RRC || op == OP_RRCS;
}

template <typename T> __device__ __forceinline__ T* pick(int buf, T* in, T* out, T* scratch) {
  return buf == 0 ? in : (buf == 1 ? out : scratch);
}

// grid = ntb * split blocks; block b runs IR thread block b / split, slice b % split.
// conns[2 * b] is the block's send connection, conns[2 * b + 1] its receive one
// (fifo == nullptr where the thread block has none).
template <typename T>
__device__ void interpret(const int* __restrict__ tbs, const int* __restrict__ steps, const int* __restrict__ deps,
                          const Conn* __restrict__ conns, T* in, T* out, T* scratch, i64 chunk, int split,
                          i64 tile, int proto, int nslots, i64 slot_bytes, u64* sems, u64* epochs) {
  const int b = blockIdx.x, tb = b / split, j = b % split, tid = threadIdx.x;
  const int step0 = tbs[tb * TB_FIELDS], nsteps = tbs[tb * TB_FIELDS + 1];
  const Conn sc = conns[2 * b], rc = conns[2 * b + 1];

  // Thread 0 reads the counters and the peer's head/tail words together (one
  // round trip); head and tail only grow, so a stale copy is a lower bound and
  // is re-read only when it does not yet admit the next slot.
  __shared__ u64 sh[3];
  u64 shead = 0, rtail = 0;
  if (tid == 0) {
    sh[0] = epochs[b];
    sh[1] = sc.fifo ? *sc.counter : 0;
    sh[2] = rc.fifo ? *rc.counter : 0;
    if (sc.fifo) shead = ld_acquire_sys(sc.head);
    if (rc.fifo && proto == PROTO_SIMPLE) rtail = ld_acquire_sys(rc.tail);
  }
  __syncthreads();
  const u64 epoch = sh[0] + 1;
  u64 sseq = sh[1], rseq = sh[2];

  // slice j of every chunk, 16-byte aligned when the chunk is
  const i64 V = 16 / sizeof(T);
  const i64 slice = ((chunk + split - 1) / split + V - 1) / V * V;
  const i64 lo = min(chunk, (i64)j * slice), hi = min(chunk, lo + slice);
  const i64 ntiles = (hi - lo + tile - 1) / tile;
  const i64 ll_piece_lines = tile * (i64)sizeof(T) / 8;

  for (i64 t = 0; t < ntiles; ++t) {
    const i64 off = lo + t * tile, n = min(tile, hi - off);
    for (int s = 0; s < nsteps; ++s) {
      const int* st = steps + (step0 + s) * STEP_FIELDS;
      const int op = st[0], ndeps = st[6];
      if (tid < ndeps) {
        const int dtb = deps[2 * (st[7] + tid)], dstep = deps[2 * (st[7] + tid) + 1];
        const u64 target = (epoch << 32) | (u64)(t * tbs[dtb * TB_FIELDS + 1] + dstep + 1);
        const u64* sem = sems + (dtb * split + j);
        while (ld_acquire_gpu(sem) < target) {
        }
      }
      if (op == OP_NOP) {
        __syncthreads();
      } else {
        const bool snd = op_sends(op), rcv = op_recvs(op);
        if (tid == 0) {
          if (snd) while (shead + nslots < sseq + 1) shead = ld_acquire_sys(sc.head);
          if (rcv && proto == PROTO_SIMPLE) while (rtail < rseq + 1) rtail = ld_acquire_sys(rc.tail);
        }
        __syncthreads();
        const int cnt = st[5];
        const i64 sslot = (i64)(sseq % nslots) * slot_bytes, rslot = (i64)(rseq % nslots) * slot_bytes;
        for (int k = 0; k < cnt; ++k) {
          T* src = pick(st[1], in, out, scratch) + (i64)(st[2] + k) * chunk + off;
          T* dst = pick(st[3], in, out, scratch) + (i64)(st[4] + k) * chunk + off;
          if (proto == PROTO_SIMPLE || op == OP_COPY || op == OP_REDUCE) {
            T* fin = rcv ? reinterpret_cast<T*>(rc.fifo + rslot) + k * tile : nullptr;
            T* fout = snd ? reinterpret_cast<T*>(sc.fifo + sslot) + k * tile : nullptr;
            run_simple<T>(op, src, dst, fin, fout, n);
          } else {
            const uint4* fin = rcv ? reinterpret_cast<const uint4*>(rc.fifo + rslot) + k * ll_piece_lines : nullptr;
            uint4* fout = snd ? reinterpret_cast<uint4*>(sc.fifo + sslot) + k * ll_piece_lines : nullptr;
            run_ll<T>(op, src, dst, fin, (u32)(rseq + 1), fout, (u32)(sseq + 1), n);
          }
        }
        __syncthreads();
        if (tid == 0) {
          if (snd && proto == PROTO_SIMPLE) st_release_sys(sc.tail, sseq + 1);
          // LL data was consumed into registers (flags checked), so a relaxed store suffices
          if (rcv) {
            if (proto == PROTO_SIMPLE) st_release_sys(rc.head, rseq + 1);
            else st_relaxed_sys(rc.head, rseq + 1);
          }
        }
        if (snd) ++sseq;
        if (rcv) ++rseq;
      }
      if (st[8] && tid == 0) st_release_gpu(sems + (tb * split + j), (epoch << 32) | (u64)(t * nsteps + s + 1));
    }
  }
  if (tid == 0) {
    if (sc.fifo) *sc.counter = sseq;
    if (rc.fifo) *rc.counter = rseq;
    epochs[b] = epoch;
  }
}

#define INTERP_ENTRY(NAME, T)                                                                                  \
  extern "C" __global__ void __launch_bounds__(MAX_THREADS) NAME(                                                     \
      const int* tbs, const int* steps, const int* deps, const Conn* conns, T* in, T* out, T* scratch,         \
      i64 chunk, int split, i64 tile, int proto, int nslots, i64 slot_bytes, u64* sems, u64* epochs) {         \
    interpret<T>(tbs, steps, deps, conns, in, out, scratch, chunk, split, tile, proto, nslots, slot_bytes,     \
                 sems, epochs);                                                                                \
  }

INTERP_ENTRY(gc3_interp_f32, float)
INTERP_ENTRY(gc3_interp_bf16, __nv_bfloat16)
INTERP_ENTRY(gc3_interp_f16, __half)
