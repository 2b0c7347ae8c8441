// y[M, O] = x[M, I] · w for a few rows M (1 ≤ M ≤ 16: an AR or draft step, a verification
// forward of γ + 1 tokens), float32, with w stored [I, O] (`F32MatmulIO`) or [O, I]
// (`F32MatmulOI`).
//
// Why a kernel: a decode step is bound by reading the weights once, and so is a
// verification of a few tokens (its arithmetic is a small fraction of what the cores do
// in the time the weights take to stream). XLA:CPU sends M ≥ 2 dots to a GEMM that streams
// the weights much more slowly than its M = 1 GEMV, and even its GEMV streams a small
// model's matrices below this kernel's rate (docs/decisions/cpu.md, C1; figures:
// docs/results/cpu-kernels.md). Here every weight is read once and used for all M rows
// while it sits in a register.
//
// Work is split into chunks that the caller and XLA's intra-op threads claim from an
// atomic counter (`workers.h`); the caller waits only for claimed chunks. A chunk is a
// contiguous block of the weights wherever that is possible: rows of an [I, O] matrix
// (partial sums, added in a fixed order, so results never depend on the threads) or
// output channels of an [O, I] one.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "workers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// w[..., I, O] or w[..., O, I], any leading dims of size 1 (what jax's `expand_dims` vmap
// adds; `_by_rows` in `__init__.py` folds a vmap's batch into x's rows and passes w as is).
using Matrix = ffi::Buffer<ffi::F32>;

// The vector registers of the target: a tile of sums must fit them with the weight
// vectors it meets and a broadcast, or GCC spills the sums to the stack on every weight
// read. AVX2 has half AVX-512's registers, each half as wide, so tiles sized for AVX-512
// spilled there (docs/decisions/cpu.md, C2).
#if defined(__AVX512F__)
constexpr int kVecBytes = 64, kRegisters = 32;
#elif defined(__AVX__)
constexpr int kVecBytes = 32, kRegisters = 16;
#elif defined(__aarch64__)
constexpr int kVecBytes = 16, kRegisters = 32;
#else
constexpr int kVecBytes = 16, kRegisters = 16;
#endif
constexpr int kLanes = kVecBytes / 4;  // floats per vector
// Rows of x per pass over the weights: up to a γ = 8 verification, whose nine rows would
// otherwise read every matrix twice; the tile for nine rows still fits the registers
// (`FitRegisters`; docs/decisions/cpu.md, C2).
constexpr int kMaxRows = 9;
constexpr int kIOWidth = 32;   // [I, O]: the widest register tile, 128 bytes of a row
constexpr int64_t kIOChunk = 512;  // [I, O]: most columns per claimed chunk (2 KiB of a row)
constexpr int64_t kOIChunkBytes = int64_t{512} << 10;  // [O, I]: weights per claimed chunk

// The most vectors (or weight rows) n, a power of two up to `most`, such that MB·n sums,
// n weight vectors and one broadcast fit the registers: the tile for MB rows of x.
constexpr int FitRegisters(int MB, int most) {
  for (int n = most; n > 1; n /= 2)
    if ((MB + 1) * n + 1 <= kRegisters) return n;
  return 1;
}

// Prefetches go to L2 (prefetcht1): there they wait for their use without taking L1's few
// fill buffers from the loads in flight (measured a little faster than prefetcht0).
constexpr int kPrefetchL2 = 2;

// The line 4 KiB further along a stream of weights, to L2, for two rows or more: there the
// loop issues its loads more slowly and the hardware prefetchers fell behind (measured
// faster 4 or 8 KiB ahead than 16 on the tied heads at five rows, the same at eight and
// nine; at one row it did not help).
// Past the end of the matrix the address is formed as an integer: a prefetch never
// faults, and no out-of-bounds pointer is made.
inline void PrefetchAhead(const float* p) {
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<std::uintptr_t>(p) + 4096),
                     0, kPrefetchL2);
}

// One vector register of floats, through GCC's vector extensions.
typedef float Vec __attribute__((vector_size(kVecBytes)));
typedef float VecU __attribute__((vector_size(kVecBytes), aligned(4)));  // unaligned access
inline Vec Load(const float* p) { return *reinterpret_cast<const VecU*>(p); }
inline void Store(float* p, Vec v) { *reinterpret_cast<VecU*>(p) = v; }
// a + x·w as one FMA, and x[0] in every lane, each an opaque instruction. Left to itself
// (this file was built with -fassociative-math until `cpu_kernels._IN_ORDER`), GCC turned
// a five-row [I, O] tile into trees of multiplies and adds and kept the broadcasts of a
// group on the stack, far from the FMA units' rate under both AVX2 and AVX-512
// (docs/decisions/cpu.md, C2). "v" names any of AVX-512's 32 registers; "x" the 16 that
// AVX2 has.
#if defined(__AVX512F__)
#define SPECJAX_VREG "v"
#elif defined(__AVX2__) && defined(__FMA__)
#define SPECJAX_VREG "x"
#endif
#ifdef SPECJAX_VREG
inline Vec Fma(Vec x, Vec w, Vec a) {
  asm("vfmadd231ps %2, %1, %0" : "+" SPECJAX_VREG(a) : SPECJAX_VREG(x), SPECJAX_VREG(w));
  return a;
}
inline Vec Broadcast(const float* p) {
  Vec v;
  asm("vbroadcastss %1, %0" : "=" SPECJAX_VREG(v) : "m"(*p));
  return v;
}
#else
inline Vec Fma(Vec x, Vec w, Vec a) { return a + x * w; }
inline Vec Broadcast(const float* p) {
  Vec v;
  for (int j = 0; j < kLanes; ++j) v[j] = *p;
  return v;
}
#endif
inline float Sum(Vec v) {
  float s = 0;
  for (int j = 0; j < kLanes; ++j) s += v[j];
  return s;
}

// Whether rows of O floats lie a multiple of 4 KiB apart (SmolLM2's gate_up: 12 KiB). Then
// the same columns of every row, and of the rows `BlockIO` prefetches, fall in one set of
// an L1 cache whose sets repeat every 4 KiB (32 KiB, 8-way: the CPUs we use), and the
// prefetched lines evict the tile's before they are read, so such matrices skip the
// prefetch; rows that spread over the sets read faster with it (docs/decisions/cpu.md,
// C3).
constexpr bool FourKiBRows(int64_t O) { return O * int64_t(sizeof(float)) % 4096 == 0; }

// Whether rows lie a multiple of 2 KiB apart: two sets of the L1 for a tile's rows and the
// prefetched ones. At five rows dropping the prefetch there was a wash; at one row, where
// the tile runs through its weights fastest, the prefetch lost on long rows. So one row
// prefetches only rows that spread over more sets.
constexpr bool TwoKiBRows(int64_t O) { return O * int64_t(sizeof(float)) % 2048 == 0; }

// [I, O]: acc[m·stride + c] += Σ_i x[m·I + i] · w[i·O + o0 + c] over rows [i0, i1) of w
// and columns c < o1 - o0, for rows x[0..MB). The weights are read eight rows at a time,
// each row's segment front to back, and every weight vector meets MB broadcast x values in
// registers; the tile's sums make one trip through `acc` per eight rows: half the loads
// and stores of `acc` per weight read that four rows made. A tile is V vectors wide, at
// most 128 bytes of a row, as many as the registers hold beside MB rows of sums. The rows
// eight ahead are prefetched, unless `FourKiBRows` (or, at one row, `TwoKiBRows`).
template <int MB>
inline void BlockIO(const float* x, const float* w, float* acc, int64_t stride, int64_t I,
                    int64_t O, int64_t i0, int64_t i1, int64_t o0, int64_t o1) {
  constexpr int kRows = 8, kAhead = 8;  // rows per group; rows ahead to prefetch
  constexpr int V = FitRegisters(MB, kIOWidth / kLanes), kWidth = V * kLanes;
  const int64_t width = o1 - o0, tiles = width / kWidth;
  const bool prefetch = !FourKiBRows(O) && !(MB == 1 && TwoKiBRows(O));
  int64_t i = i0;
  for (; i + kRows <= i1; i += kRows) {
    float xs[kRows][MB];
    for (int r = 0; r < kRows; ++r)
      for (int m = 0; m < MB; ++m) xs[r][m] = x[m * I + i + r];
    const bool ahead = prefetch && i + kRows + kAhead <= I;  // one test per group
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t c = t * kWidth;
      Vec a[MB][V];
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) a[m][v] = Load(acc + m * stride + c + v * kLanes);
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) {
        const float* wr = w + (i + r) * O + o0 + c;
        if (ahead)  // the same columns of a later row: a new stream
#pragma GCC unroll 4
          for (int b = 0; b < V * kVecBytes; b += 64)  // each cache line of the tile
            __builtin_prefetch(reinterpret_cast<const char*>(wr + kAhead * O) + b, 0,
                               kPrefetchL2);
        Vec wv[V];
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) wv[v] = Load(wr + v * kLanes);
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) {
          const Vec xb = Broadcast(&xs[r][m]);
#pragma GCC unroll 4
          for (int v = 0; v < V; ++v) a[m][v] = Fma(xb, wv[v], a[m][v]);
        }
      }
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) Store(acc + m * stride + c + v * kLanes, a[m][v]);
    }
    for (int64_t c = tiles * kWidth; c < width; ++c)  // columns past the last full tile
      for (int r = 0; r < kRows; ++r)
        for (int m = 0; m < MB; ++m) acc[m * stride + c] += xs[r][m] * w[(i + r) * O + o0 + c];
  }
  for (; i < i1; ++i)  // rows past the last group of eight
    for (int64_t c = 0; c < width; ++c)
      for (int m = 0; m < MB; ++m) acc[m * stride + c] += x[m * I + i] * w[i * O + o0 + c];
}

// [I, O] by columns: y[:, o0:o1) (at most kIOChunk columns) from every row of w, the sums
// in L1. For wide matrices (an untied LM head), where a block of rows would need
// MB × O partial sums.
template <int MB>
struct ColumnsIO {
  static void Run(const float* x, const float* w, float* y, int64_t I, int64_t O,
                  int64_t o0, int64_t o1) {
    alignas(64) float acc[MB][kIOChunk] = {};
    BlockIO<MB>(x, w, &acc[0][0], kIOChunk, I, O, 0, I, o0, o1);
    for (int m = 0; m < MB; ++m)
      for (int64_t c = 0; c < o1 - o0; ++c) y[m * O + o0 + c] = acc[m][c];
  }
};

// [I, O] by rows: the partial sums part[MB, O] (row stride O) of rows [i0, i1) of w. Each
// chunk is one contiguous block of memory, which the prefetchers stream far better than
// column strips (five rows this way take less than XLA's dot at one row:
// docs/results/cpu-kernels.md).
template <int MB>
struct RowsIO {
  static void Run(const float* x, const float* w, float* part, int64_t I, int64_t O,
                  int64_t i0, int64_t i1) {
    std::fill(part, part + MB * O, 0.0f);
    BlockIO<MB>(x, w, part, O, I, O, i0, i1, 0, O);
  }
};

// [O, I]: output channels o + s·stride (s < S) for rows x[0..MB): S·MB dot products over
// S weight rows far apart, each read once, every x vector loaded meeting the S weight
// vectors. Channels far apart are S long sequential streams across a chunk, which the
// hardware prefetchers keep up with, where channels side by side are short streams that
// they keep losing (as `int8_matmul.cc` found). Each dot product is one chain of FMAs over
// I in order, summed across lanes at the end, whatever MB and S. This file is compiled
// without reassociation (`cpu_kernels._IN_ORDER`), so a row's outputs have the same bits
// whatever rows share its call: a verification's logits equal the AR step's. (Before, one
// row took four chains, and GCC reordered one-row and five-row sums differently: the tied
// head's logits differed in their last bits.)
template <int MB, int S>
inline void StreamsOI(const float* x, const float* w, float* y, int64_t I, int64_t O,
                      int64_t o, int64_t stride) {
  Vec acc[S][MB] = {};
  int64_t i = 0;
  for (; i + kLanes <= I; i += kLanes) {
    Vec wv[S];
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      const float* ws = w + (o + s * stride) * I + i;
      if constexpr (MB > 1) PrefetchAhead(ws);
      wv[s] = Load(ws);
    }
#pragma GCC unroll 9
    for (int m = 0; m < MB; ++m) {
      const Vec xv = Load(x + m * I + i);
#pragma GCC unroll 4
      for (int s = 0; s < S; ++s) acc[s][m] = Fma(xv, wv[s], acc[s][m]);
    }
  }
  for (int s = 0; s < S; ++s)
    for (int m = 0; m < MB; ++m) {
      const int64_t c = o + s * stride;
      float sum = Sum(acc[s][m]);
      for (int64_t k = i; k < I; ++k) sum += x[m * I + k] * w[c * I + k];
      y[m * O + c] = sum;
    }
}

template <template <int> class Fn, typename... Args>
inline void Dispatch(int64_t rows, Args... args) {
  switch (rows) {
    case 1: Fn<1>::Run(args...); break;
    case 2: Fn<2>::Run(args...); break;
    case 3: Fn<3>::Run(args...); break;
    case 4: Fn<4>::Run(args...); break;
    case 5: Fn<5>::Run(args...); break;
    case 6: Fn<6>::Run(args...); break;
    case 7: Fn<7>::Run(args...); break;
    case 8: Fn<8>::Run(args...); break;
    default: Fn<9>::Run(args...); break;
  }
}

template <int MB>
struct ChunkOI {
  // The two halves of the chunk side by side (`StreamsOI`): two long streams far apart
  // read a tied head faster, at one row and at five, than four or one channel at a time
  // side by side, or four streams (the variants alternated in one process).
  static void Run(const float* x, const float* w, float* y, int64_t I, int64_t O,
                  int64_t o0, int64_t o1) {
    const int64_t half = (o1 - o0) / 2;
    for (int64_t k = 0; k < half; ++k) StreamsOI<MB, 2>(x, w, y, I, O, o0 + k, half);
    if (o0 + 2 * half < o1) StreamsOI<MB, 1>(x, w, y, I, O, o1 - 1, 0);
  }
};

// [I, O] by columns: columns per chunk, at most kIOChunk, a whole number of tiles, and as
// even a split over the workers as that allows (576 on 2 threads: 288 + 288, not 512 + 64).
inline int64_t IOChunk(int64_t O, int64_t threads) {
  const int64_t workers = std::max<int64_t>(1, threads);
  const int64_t rounds = (O + workers * kIOChunk - 1) / (workers * kIOChunk);
  const int64_t width = (O + workers * rounds - 1) / (workers * rounds);
  return std::min(kIOChunk, (width + kIOWidth - 1) / kIOWidth * kIOWidth);
}

// [O, I]: output channels per chunk, about kOIChunkBytes of weights (chunks much smaller
// than that were measured slower; larger ones did not differ), and at least four chunks
// per worker, so that a helper that starts late costs at most a quarter of its share.
inline int64_t OIChunk(int64_t I, int64_t O, int64_t threads) {
  const int64_t by_bytes = std::max<int64_t>(8, kOIChunkBytes / (I * int64_t(sizeof(float))));
  const int64_t pieces = 4 * std::max<int64_t>(1, threads);
  return std::max<int64_t>(1, std::min(by_bytes, (O + pieces - 1) / pieces));
}

// How a matmul is cut into chunks: [I, O] by rows (partial sums, added in chunk order) or
// by columns, [O, I] by output channels.
enum class Split { kRowsIO, kColumnsIO, kRowsOI };

// [I, O] matrices up to this many columns are cut by rows: a chunk's partial sums for the
// rows of x in a pass, at most 9 × O floats (1.1 MiB), stay in L2.
constexpr int64_t kRowSplitMaxO = 32768;

class Work : public specjax::Job {
 public:
  Work(const float* x, const float* w, float* y, int64_t M, int64_t I, int64_t O,
       Split split, int64_t chunk, int64_t chunks)
      : Job(chunks), x(x), w(w), y(y), M(M), I(I), O(O), split(split), chunk(chunk),
        parts(split == Split::kRowsIO ? new float[chunks * M * O] : nullptr) {}

  bool split_rows() const { return split == Split::kRowsIO; }

  // kRowsIO: y = the chunks' partial sums added in chunk order, so the result does not
  // depend on which thread ran which chunk.
  void Reduce() const {
    const int64_t n = M * O;
    const float* p = parts.get();
    std::copy(p, p + n, y);
    for (int64_t c = 1; c < chunks(); ++c)
      for (int64_t j = 0; j < n; ++j) y[j] += p[c * n + j];
  }

 protected:
  void Chunk(int64_t c) override {
    const int64_t bound = split == Split::kRowsIO ? I : O;
    const int64_t lo = c * chunk, hi = std::min(bound, lo + chunk);
    for (int64_t m = 0; m < M; m += kMaxRows) {
      const int64_t rows = std::min<int64_t>(kMaxRows, M - m);
      switch (split) {
        case Split::kRowsIO:
          Dispatch<RowsIO>(rows, x + m * I, w, parts.get() + (c * M + m) * O, I, O, lo, hi);
          break;
        case Split::kColumnsIO:
          Dispatch<ColumnsIO>(rows, x + m * I, w, y + m * O, I, O, lo, hi);
          break;
        case Split::kRowsOI:
          Dispatch<ChunkOI>(rows, x + m * I, w, y + m * O, I, O, lo, hi);
          break;
      }
    }
  }

 private:
  const float* x;
  const float* w;
  float* y;
  const int64_t M, I, O;
  const Split split;
  const int64_t chunk;                   // rows (kRowsIO) or output channels per chunk
  const std::unique_ptr<float[]> parts;  // kRowsIO: chunks × M × O partial sums
};

// [I, O] by rows: two chunks per worker, so a helper that starts late costs at most a
// chunk; whole groups of eight rows.
inline int64_t RowChunk(int64_t I, int64_t threads) {
  const int64_t pieces = 2 * std::max<int64_t>(1, threads);
  return std::max<int64_t>(8, ((I + pieces - 1) / pieces + 7) / 8 * 8);
}

// The chunks of y[M, O] = x[M, I] · w for `threads` workers.
std::shared_ptr<Work> Plan(const float* x, const float* w, float* y, int64_t M, int64_t I,
                           int64_t O, bool io, int64_t threads) {
  if (!io) {
    const int64_t chunk = OIChunk(I, O, threads);
    return std::make_shared<Work>(x, w, y, M, I, O, Split::kRowsOI, chunk,
                                  (O + chunk - 1) / chunk);
  }
  if (O <= kRowSplitMaxO) {
    const int64_t chunk = RowChunk(I, threads);
    return std::make_shared<Work>(x, w, y, M, I, O, Split::kRowsIO, chunk,
                                  (I + chunk - 1) / chunk);
  }
  const int64_t chunk = IOChunk(O, threads);
  return std::make_shared<Work>(x, w, y, M, I, O, Split::kColumnsIO, chunk,
                                (O + chunk - 1) / chunk);
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, Matrix w,
                  ffi::ResultBuffer<ffi::F32> y, bool io) {
  auto wd = w.dimensions();
  const size_t r = wd.size();
  if (r < 2 || w.element_count() != wd[r - 2] * wd[r - 1])
    return ffi::Error::InvalidArgument("f32_matmul: one weight matrix (w batched by vmap?)");
  const int64_t I = wd[io ? r - 2 : r - 1], O = wd[io ? r - 1 : r - 2];
  auto xd = x.dimensions();
  if (xd.size() == 0 || xd[xd.size() - 1] != I)
    return ffi::Error::InvalidArgument("f32_matmul: x[..., I] against w[I, O] or w[O, I]");
  const int64_t threads = specjax::ThreadsFor(I * O * 4, pool.num_threads());
  auto work = Plan(x.typed_data(), w.typed_data(), y->typed_data(), x.element_count() / I,
                   I, O, io, threads);
  specjax::RunOnPool(pool, work, threads);
  if (work->split_rows()) work->Reduce();
  return ffi::Error::Success();
}

ffi::Error MatmulIO(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, Matrix w,
                    ffi::ResultBuffer<ffi::F32> y) {
  return Matmul(pool, x, w, y, true);
}

ffi::Error MatmulOI(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, Matrix w,
                    ffi::ResultBuffer<ffi::F32> y) {
  return Matmul(pool, x, w, y, false);
}

}  // namespace

#define SPECJAX_F32_MATMUL(name, impl)                        \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl,                   \
                                ffi::Ffi::Bind()              \
                                    .Ctx<ffi::ThreadPool>()   \
                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                    .Arg<Matrix>()                \
                                    .Ret<ffi::Buffer<ffi::F32>>());

SPECJAX_F32_MATMUL(F32MatmulIO, MatmulIO)
SPECJAX_F32_MATMUL(F32MatmulOI, MatmulOI)
