// Ceilings measured beside the interpreter by python -m kernels bench --sweep (same run,
// same graphs, same GPUs): what a call cannot beat on this machine.
//   empty_kernel:  the cost of one kernel node in a CUDA graph (launch floor).
//   oneshot_ll_allreduce_f32: the minimal 2-rank LL allreduce, one block: each
//     thread reads the call counter, pushes its 8-byte lines {data, flag} into
//     the peer's buffer, polls its own buffer, adds, stores. Two buffers by call
//     parity need no acknowledgement (a rank reaches call k+2 only after the peer
//     finished call k), so this is the interpreter's LL path without its
//     generality (no program decode, no head/tail, no block barriers per step).
//   push_copy: SM stores into the peer's memory, 16-byte accesses, 4 in flight.
typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;

extern "C" __global__ void empty_kernel() {}

extern "C" __global__ void oneshot_ll_allreduce_f32(const float* in, float* out, i64 n, uint4* peer, uint4* mine,
                                                    u64* counter) {
  const u64 seq = *(volatile u64*)counter + 1;
  const u32 flag = (u32)seq;
  const i64 nlines = n / 2, base = (seq & 1) * nlines;
  const uint2* in2 = reinterpret_cast<const uint2*>(in);
  uint2* out2 = reinterpret_cast<uint2*>(out);
  for (i64 l = threadIdx.x; l < nlines; l += blockDim.x) {
    uint2 v = in2[l];
    asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(peer + base + l), "r"(v.x), "r"(flag),
                 "r"(v.y), "r"(flag) : "memory");
    uint4 r;
    do {
      asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                   : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(mine + base + l) : "memory");
    } while (r.y != flag || r.w != flag);
    out2[l] = make_uint2(__float_as_uint(__uint_as_float(v.x) + __uint_as_float(r.x)),
                         __float_as_uint(__uint_as_float(v.y) + __uint_as_float(r.z)));
  }
  __syncthreads();
  if (threadIdx.x == 0) *counter = seq;
}

extern "C" __global__ void push_copy(const uint4* src, uint4* dst, i64 n) {
  const i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (i + u * stride < n) v[u] = __ldcg(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (i + u * stride < n) __stcg(dst + i + u * stride, v[u]);
  }
}
