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
// FIFO of `nslots` slots (a power of two) in the receiver's memory, written by the sender over
// NVLink/P2P (push: the faster direction on H200, see the baseline notes).
//   Simple: the sender writes a slot, then releases `tail` (in the receiver's
//           memory) at system scope; the receiver acquires `tail`, reads.
//   LL:     16-byte lines {data0, flag, data1, flag}; the flag is the slot's
//           sequence number, so the receiver polls the line itself.
//   LL128:  128-byte lines of 120 data bytes and a 64-bit flag, each written and
//           read by 8 threads in one instruction (see pass_ll128).
// Both: the receiver releases `head` (in the sender's memory) once a slot is
// consumed; the sender waits for head >= seq + 1 - nslots before reusing it.
// Each end of a connection has one line in its rank's memory holding its
// sequence counter and the word the peer writes (head at the sender, tail at the
// receiver). They persist, so nothing is reset between calls and a CUDA graph
// can replay the launch.
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
#define PROTO_LL128 2

// The launch's parameters (one struct passed by value, __grid_constant__, so the
// program image sits in the constant bank) and the program image, built by
// kernels/interp/pack.py (PARAMS, image()); the offsets below are checked against
// pack.PARAMS in tests/kernels/test_interp_image.py.
// Image (u64 words):
//   thread block tb, TB_WORDS words at tb * TB_WORDS: send FIFO (the peer's), send
//     line (ours), the peer's receive line, receive FIFO (ours), receive line
//     (ours), the peer's send line (0 where the thread block has no such end; all
//     for slice 0: slice j adds j * FIFO bytes and j * LINE_BYTES), nsteps;
//   step s of tb, STEP_WORDS words at steps_at + (tb * stride + s) * STEP_WORDS:
//     op | srcbuf << 8 | dstbuf << 16 | has_dep << 24 | cnt << 32,
//     srcoff | dstoff << 32, ndeps | dep_start << 32;
//   dependency d at deps_at + d: thread block | step << 32.
// A line (LINE_BYTES, kernels/interp/layout.py) holds word 0, the end's sequence
// counter (ours), and word 1, the word the peer writes (head in a send line, tail
// in a receive line).
#define MAX_THREADS 512
#define IMG_WORDS 256
#define TB_WORDS 7
#define STEP_WORDS 3
#define LINE_BYTES 64

struct Params {
  u64 buf[3];        // input, output, scratch
  i64 chunk;         // elements per chunk
  i64 slice;         // elements of a chunk per CUDA block (a multiple of 16 bytes)
  i64 tile;          // elements per step and tile
  i64 slot_bytes;
  u64* sems;         // per block, monotonic (calls + 1) << 32 | progress
  u64* epochs;       // per block, calls so far
  const u64* gimg;   // the image in global memory when it does not fit img; else nullptr
  int split, proto, slot_mask, stride;   // slot_mask: slots - 1 (slots a power of two)
  int steps_at, deps_at;
  u64 img[IMG_WORDS];
};
#ifdef __CUDACC_RTC__  // NVRTC has no offsetof; the nvcc build (CI) checks the layout
#define PARAMS_AT(FIELD, OFFSET)
#else
#define PARAMS_AT(FIELD, OFFSET) static_assert(__builtin_offsetof(Params, FIELD) == OFFSET, "Params layout")
#endif
PARAMS_AT(buf, 0);
PARAMS_AT(chunk, 24);
PARAMS_AT(slice, 32);
PARAMS_AT(tile, 40);
PARAMS_AT(slot_bytes, 48);
PARAMS_AT(sems, 56);
PARAMS_AT(epochs, 64);
PARAMS_AT(gimg, 72);
PARAMS_AT(split, 80);
PARAMS_AT(proto, 84);
PARAMS_AT(slot_mask, 88);
PARAMS_AT(stride, 92);
PARAMS_AT(steps_at, 96);
PARAMS_AT(deps_at, 100);
PARAMS_AT(img, 104);
static_assert(sizeof(Params) == 104 + 8 * IMG_WORDS, "Params layout");

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
__device__ __forceinline__ u64 ld_relaxed_sys(const u64* p) {
  u64 v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
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
__device__ __forceinline__ void st_16(uint4* p, uint4 v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
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

// v, opaque to the compiler: pins the first use of a loaded value where it is
// written, so that the compiler does not hoist it (and the wait for the load)
// ahead of later loads that could have been in flight meanwhile.
__device__ __forceinline__ u64 pinned(u64 v) {
  asm volatile("" : "+l"(v));
  return v;
}

// The send side of an LL pass. The FIFO slot (and so the flag) is chosen, and the
// credit checked, only after the round's loads are issued: the wait for the
// block's state then overlaps the wait for the source data.
struct LLSend {
  uint4* fifo;       // this piece in slot 0 of the peer's FIFO
  i64 slot_lines;    // 16-byte lines per slot
  u64 seq;           // the slot's sequence number
  int slot_mask;     // slots - 1
  const u64* head;   // our head word (written by the peer)
  u64* seen;         // our copy of it: head only grows, so a stale copy is a lower bound
};

// a from our LL FIFO (AF) or from a local buffer; o2 is the peer's LL FIFO.
// LL_U lines per thread per round: the local operand loads and the first poll of
// every line are issued before any flag is checked, so a thread waits about one
// latency per round instead of one per line.
#define LL_U 4
template <typename T, bool AF, bool HB, bool HO1, bool HO2>
__device__ void pass_ll(const T* a, const uint4* fin, u32 fin_flag, const T* b, T* o1, const LLSend& out, i64 n) {
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
    uint4* fout = nullptr;
    u32 fout_flag = 0;
    if (HO2) {
      const u64 seq = pinned(out.seq);   // first used after the loads above are issued
      // every lane reads the same word: one request per warp
      while (*out.seen + out.slot_mask + 1 < seq + 1) *out.seen = ld_relaxed_sys(out.head);
      fout = out.fifo + (i64)(seq & out.slot_mask) * out.slot_lines;
      fout_flag = (u32)(seq + 1);
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

// ---- LL128: 128-byte lines of 120 data bytes (15 u64 words) and a u64 flag ----
// The 8 threads of a line (lanes 8i..8i+7 of a warp) load or store it with one
// instruction, 16 bytes each, so NVLink carries it as one 128-byte access: a
// reader that sees the flag (the last word, thread 7's) sees the whole line. NCCL's
// LL128 relies on the same property of NVLink. Thread t holds words 2t and 2t+1 of
// its line; thread 7 holds word 14 and the flag (the slot's sequence number + 1).
// A warp handles 4 lines per round, LL128_U rounds at once; a warp whose lines are not
// all flagged reloads all of them, so every line's data comes from the load that saw
// its flag.
#define LL128_U 2
template <typename T, bool AF, bool HB, bool HO1, bool HO2>
__device__ void pass_ll128(const T* a, const uint4* fin, u64 fin_flag, const T* b, T* o1, const LLSend& out,
                           i64 n) {
  const i64 nwords = (n * (i64)sizeof(T) + 7) / 8;
  const i64 nlines = (nwords + 14) / 15;
  const int lane = threadIdx.x & 31, t = lane & 7;
  const bool flagger = t == 7;
  const i64 stride = (i64)(blockDim.x >> 5) * 4;   // lines per round of the block
  for (i64 base = (i64)(threadIdx.x >> 5) * 4; base < nlines; base += stride * LL128_U) {   // warp-uniform
    uint2 v[LL128_U][2], w[LL128_U][2];
    uint4 line[LL128_U];
#pragma unroll
    for (int u = 0; u < LL128_U; ++u) {
      v[u][0] = v[u][1] = w[u][0] = w[u][1] = make_uint2(0, 0);
      line[u] = make_uint4(0, 0, 0, 0);
      const i64 l = base + u * stride + (lane >> 3), w0 = l * 15 + 2 * t;
      if (l < nlines) {
        if (HB) {
          w[u][0] = load8<T>(b, w0, n);
          if (!flagger) w[u][1] = load8<T>(b, w0 + 1, n);
        }
        if (AF) {
          line[u] = ld_ll(fin + l * 8 + t);
        } else {
          v[u][0] = load8<T>(a, w0, n);
          if (!flagger) v[u][1] = load8<T>(a, w0 + 1, n);
        }
      }
    }
    uint4* fout = nullptr;
    u64 fout_flag = 0;
    if (HO2) {
      const u64 seq = pinned(out.seq);   // first used after the loads above are issued
      while (*out.seen + out.slot_mask + 1 < seq + 1) *out.seen = ld_relaxed_sys(out.head);
      fout = out.fifo + (i64)(seq & out.slot_mask) * out.slot_lines;
      fout_flag = seq + 1;
    }
    if (AF) {
      while (true) {
        bool again = false;
#pragma unroll
        for (int u = 0; u < LL128_U; ++u) {
          const i64 l = base + u * stride + (lane >> 3);
          if (l < nlines && flagger && ((u64)line[u].w << 32 | line[u].z) != fin_flag) again = true;
        }
        if (!__any_sync(0xffffffffu, again)) break;
#pragma unroll
        for (int u = 0; u < LL128_U; ++u) {
          const i64 l = base + u * stride + (lane >> 3);
          if (l < nlines) line[u] = ld_ll(fin + l * 8 + t);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < LL128_U; ++u) {
      const i64 l = base + u * stride + (lane >> 3), w0 = l * 15 + 2 * t;
      if (AF) {
        v[u][0] = make_uint2(line[u].x, line[u].y);
        v[u][1] = make_uint2(line[u].z, line[u].w);
      }
      if (HB) {
        v[u][0] = add8<T>(v[u][0], w[u][0]);
        if (!flagger) v[u][1] = add8<T>(v[u][1], w[u][1]);
      }
      if (HO1 && l < nlines) {
        store8<T>(o1, w0, n, v[u][0]);
        if (!flagger) store8<T>(o1, w0 + 1, n, v[u][1]);
      }
    }
    if (HO2) {
      __syncwarp();
#pragma unroll
      for (int u = 0; u < LL128_U; ++u) {
        const i64 l = base + u * stride + (lane >> 3);
        if (l < nlines) {
          const uint2 hi = flagger ? make_uint2((u32)fout_flag, (u32)(fout_flag >> 32)) : v[u][1];
          st_16(fout + l * 8 + t, make_uint4(v[u][0].x, v[u][0].y, hi.x, hi.y));
        }
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
__device__ void run_ll(int op, T* src, T* dst, const uint4* fin, u32 fin_flag, const LLSend& out, i64 n) {
  switch (op) {
    case OP_SEND: pass_ll<T, false, false, false, true>(src, nullptr, 0, nullptr, nullptr, out, n); break;
    case OP_RECV: pass_ll<T, true, false, true, false>(nullptr, fin, fin_flag, nullptr, dst, out, n); break;
    case OP_RCS: pass_ll<T, true, false, true, true>(nullptr, fin, fin_flag, nullptr, dst, out, n); break;
    case OP_RRS: pass_ll<T, true, true, false, true>(nullptr, fin, fin_flag, src, nullptr, out, n); break;
    case OP_RRC: pass_ll<T, true, true, true, false>(nullptr, fin, fin_flag, src, dst, out, n); break;
    case OP_RRCS: pass_ll<T, true, true, true, true>(nullptr, fin, fin_flag, src, dst, out, n); break;
    default: break;
  }
}

template <typename T>
__device__ void run_ll128(int op, T* src, T* dst, const uint4* fin, u64 fin_flag, const LLSend& out, i64 n) {
  switch (op) {
    case OP_SEND: pass_ll128<T, false, false, false, true>(src, nullptr, 0, nullptr, nullptr, out, n); break;
    case OP_RECV: pass_ll128<T, true, false, true, false>(nullptr, fin, fin_flag, nullptr, dst, out, n); break;
    case OP_RCS: pass_ll128<T, true, false, true, true>(nullptr, fin, fin_flag, nullptr, dst, out, n); break;
    case OP_RRS: pass_ll128<T, true, true, false, true>(nullptr, fin, fin_flag, src, nullptr, out, n); break;
    case OP_RRC: pass_ll128<T, true, true, true, false>(nullptr, fin, fin_flag, src, dst, out, n); break;
    case OP_RRCS: pass_ll128<T, true, true, true, true>(nullptr, fin, fin_flag, src, dst, out, n); break;
    default: break;
  }
}

__device__ __forceinline__ bool op_sends(int op) { return op == OP_SEND || op == OP_RCS || op == OP_RRS || op == OP_RRCS; }
__device__ __forceinline__ bool op_recvs(int op) {
  return op == OP_RECV || op == OP_RCS || op == OP_RRS || op == OP_RRC || op == OP_RRCS;
}

struct Step {
  int op, srcbuf, dstbuf, has_dep, cnt, srcoff, dstoff, ndeps, dep_start;
};

// N consecutive words of the program image, all loads issued before any is used:
// from the parameters (constant bank) or, for a program too large for them, from
// global memory.
template <int N> __device__ __forceinline__ void load_words(const Params& p, int at, u64 (&w)[N]) {
  if (p.gimg) {
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = __ldg(p.gimg + at + i);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = p.img[at + i];
  }
}
__device__ __forceinline__ u64 img_word(const Params& p, int i) { return p.gimg ? __ldg(p.gimg + i) : p.img[i]; }
__device__ __forceinline__ int step_at(const Params& p, int tb, int s) {
  return p.steps_at + (tb * p.stride + s) * STEP_WORDS;
}

__device__ __forceinline__ Step decode_step(const u64 (&w)[STEP_WORDS]) {
  Step st;
  st.op = (int)(w[0] & 0xff);
  st.srcbuf = (int)((w[0] >> 8) & 0xff);
  st.dstbuf = (int)((w[0] >> 16) & 0xff);
  st.has_dep = (int)((w[0] >> 24) & 0xff);
  st.cnt = (int)(w[0] >> 32);
  st.srcoff = (int)(u32)w[1];
  st.dstoff = (int)(w[1] >> 32);
  st.ndeps = (int)(u32)w[2];
  st.dep_start = (int)(w[2] >> 32);
  return st;
}

// buffer 0, 1, 2 (input, output, scratch) from fixed parameter offsets (no indexed load)
template <typename T> __device__ __forceinline__ T* buffer(const Params& p, int i) {
  return reinterpret_cast<T*>(i == 0 ? p.buf[0] : (i == 1 ? p.buf[1] : p.buf[2]));
}

// slice j's address of a slice-0 address (0 stays 0: no such end)
template <typename T> __device__ __forceinline__ T* sliced(u64 base, u64 bytes) {
  return reinterpret_cast<T*>(base + (base ? bytes : 0));
}

// grid = ntb * split blocks; block b runs IR thread block b / split, slice b % split.
// Before a block's first remote store there is one round of image loads (the
// thread block's record and its first step, from the constant bank), then the
// block's lines and the source data load in parallel; in LL no block barrier:
// every thread reads the block's state itself and every warp checks the FIFO
// credit on its own copy. One barrier closes each step (slot fully written or
// consumed, results visible to the next step); then thread 0 releases tail/head
// and the step's semaphore. Simple keeps a barrier after thread 0's FIFO check.
template <typename T, int PROTO>
__device__ __forceinline__ void interpret(const Params& p) {
  const int b = blockIdx.x, tb = b / p.split, j = b - tb * p.split, tid = threadIdx.x;
  constexpr bool simple = PROTO == PROTO_SIMPLE;
  u64 rw[TB_WORDS], sw[STEP_WORDS];
  load_words(p, tb * TB_WORDS, rw);
  load_words(p, step_at(p, tb, 0), sw);
  const u64 fj = (u64)j * (u64)(p.slot_mask + 1) * (u64)p.slot_bytes, lj = (u64)j * LINE_BYTES;
  char* const sfifo = sliced<char>(rw[0], fj);
  u64* const sline = sliced<u64>(rw[1], lj);
  u64* const speer = sliced<u64>(rw[2], lj);
  char* const rfifo = sliced<char>(rw[3], fj);
  u64* const rline = sliced<u64>(rw[4], lj);
  u64* const rpeer = sliced<u64>(rw[5], lj);
  const int nsteps = (int)rw[6];

  // Head and tail only grow, so a stale copy is a lower bound, re-read only when
  // it does not yet admit the next slot. Simple: thread 0 checks them and a
  // barrier passes the word on (as many pollers as blocks at large sizes). LL:
  // every warp checks the head on its own copy, without acquire: a slot's lines
  // carry their own flags, and a slot is rewritten only after the head says the
  // peer consumed it (a control dependency, as in NCCL's LL).
  u64 sseq = 0, shead = 0, rseq = 0, rtail = 0;
  if (sline) {
    sseq = __ldcg(sline);
    if (!simple) shead = ld_relaxed_sys(sline + 1);
    else if (tid == 0) shead = ld_acquire_sys(sline + 1);
  }
  if (rline) {
    rseq = __ldcg(rline);
    if (simple && tid == 0) rtail = ld_acquire_sys(rline + 1);
  }
  const u64 calls = p.epochs[b];   // used (pinned) only where a semaphore needs the epoch
  const u64 nslots = (u64)p.slot_mask + 1;

  // slice j of every chunk (p.slice: 16-byte aligned when the chunk is)
  const i64 lo = min(p.chunk, (i64)j * p.slice), hi = min(p.chunk, lo + p.slice);
  // a piece (one chunk's tile) in 16-byte units of a slot: LL 8 data bytes per unit, LL128 120 per 8 units
  constexpr bool ll128 = PROTO == PROTO_LL128;
  const i64 piece16 = ll128 ? p.tile * (i64)sizeof(T) / 120 * 8 : p.tile * (i64)sizeof(T) / 8;

  i64 t = 0;
  for (i64 off = lo; off < hi; off += p.tile, ++t) {
    const i64 n = min(p.tile, hi - off);
    for (int s = 0; s < nsteps; ++s) {
      const Step st = decode_step(sw);
      load_words(p, step_at(p, tb, s + 1 < nsteps ? s + 1 : 0), sw);   // the next step, in the background
      if (st.ndeps) {
        for (int d = tid; d < st.ndeps; d += blockDim.x) {
          const u64 w = img_word(p, p.deps_at + st.dep_start + d);
          const int dtb = (int)(u32)w, dstep = (int)(w >> 32);
          const i64 dn = (i64)img_word(p, dtb * TB_WORDS + TB_WORDS - 1);
          const u64 target = (pinned(calls) + 1) << 32 | (u64)(t * dn + dstep + 1);
          const u64* sem = p.sems + (dtb * p.split + j);
          while (ld_acquire_gpu(sem) < target) {
          }
        }
        __syncthreads();
      }
      const bool snd = op_sends(st.op), rcv = op_recvs(st.op);
      if (st.op != OP_NOP) {
        if (simple) {
          if (tid == 0) {
            if (snd) while (shead + nslots < sseq + 1) shead = ld_acquire_sys(sline + 1);
            if (rcv) while (rtail < rseq + 1) rtail = ld_acquire_sys(rline + 1);
          }
          __syncthreads();
        }
        T* const src0 = buffer<T>(p, st.srcbuf) + (i64)st.srcoff * p.chunk + off;
        T* const dst0 = buffer<T>(p, st.dstbuf) + (i64)st.dstoff * p.chunk + off;
        for (int k = 0; k < st.cnt; ++k) {
          T* src = src0 + (i64)k * p.chunk;
          T* dst = dst0 + (i64)k * p.chunk;
          if (simple || st.op == OP_COPY || st.op == OP_REDUCE) {
            const i64 sslot = (i64)(sseq & p.slot_mask) * p.slot_bytes;
            const i64 rslot = (i64)(rseq & p.slot_mask) * p.slot_bytes;
            T* fin = rcv ? reinterpret_cast<T*>(rfifo + rslot) + k * p.tile : nullptr;
            T* fout = snd ? reinterpret_cast<T*>(sfifo + sslot) + k * p.tile : nullptr;
            run_simple<T>(st.op, src, dst, fin, fout, n);
          } else if constexpr (!simple) {
            const i64 rslot = (i64)(rseq & p.slot_mask) * p.slot_bytes;
            const uint4* fin = rcv ? reinterpret_cast<const uint4*>(rfifo + rslot) + k * piece16 : nullptr;
            const LLSend out{snd ? reinterpret_cast<uint4*>(sfifo) + k * piece16 : nullptr,
                             p.slot_bytes / 16, sseq, p.slot_mask, sline + 1, &shead};
            if constexpr (ll128) run_ll128<T>(st.op, src, dst, fin, rseq + 1, out, n);
            else run_ll<T>(st.op, src, dst, fin, (u32)(rseq + 1), out, n);
          }
        }
      }
      __syncthreads();
      if (tid == 0) {
        if (snd && simple) st_release_sys(speer + 1, sseq + 1);
        // LL data was consumed into registers (flags checked), so a relaxed store
        // suffices, and only every half FIFO: the sender then runs at most half a
        // FIFO ahead, and most small calls end without a remote store to wait for.
        if (rcv) {
          if (simple) st_release_sys(rpeer + 1, rseq + 1);
          else if (((rseq + 1) & (u64)(p.slot_mask >> 1)) == 0) st_relaxed_sys(rpeer + 1, rseq + 1);
        }
        if (st.has_dep) st_release_gpu(p.sems + b, (pinned(calls) + 1) << 32 | (u64)(t * nsteps + s + 1));
      }
      if (snd) ++sseq;
      if (rcv) ++rseq;
    }
  }
  // Every thread read the counters and the calls before the first step's barrier;
  // a block without steps leaves its counters as they were.
  if (tid == 0) {
    if (sline) sline[0] = sseq;
    if (rline) rline[0] = rseq;
    p.epochs[b] = calls + 1;
  }
}

// One kernel per element type and protocol: a launch runs only its protocol's code,
// so the small-message path (LL) is not slowed by the LL128 and Simple code around it
// (a kernel with all three was 0.4 us slower per call at 1 KiB than one without LL128).
#define INTERP_ENTRY(NAME, T, PROTO) \
  extern "C" __global__ void __launch_bounds__(MAX_THREADS) NAME(const __grid_constant__ Params p) { \
    interpret<T, PROTO>(p);                                                                           \
  }

INTERP_ENTRY(gc3_interp_f32_simple, float, PROTO_SIMPLE)
INTERP_ENTRY(gc3_interp_f32_ll, float, PROTO_LL)
INTERP_ENTRY(gc3_interp_f32_ll128, float, PROTO_LL128)
INTERP_ENTRY(gc3_interp_bf16_simple, __nv_bfloat16, PROTO_SIMPLE)
INTERP_ENTRY(gc3_interp_bf16_ll, __nv_bfloat16, PROTO_LL)
INTERP_ENTRY(gc3_interp_bf16_ll128, __nv_bfloat16, PROTO_LL128)
INTERP_ENTRY(gc3_interp_f16_simple, __half, PROTO_SIMPLE)
INTERP_ENTRY(gc3_interp_f16_ll, __half, PROTO_LL)
INTERP_ENTRY(gc3_interp_f16_ll128, __half, PROTO_LL128)
