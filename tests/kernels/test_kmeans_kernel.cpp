// GPU test: K-means segment selection (thinkv::kernels::launch_kmeans_select) against the CPU
// reference thinkv::kmeans_select, every kept index compared (the kernel claims bit-exactness, so
// no tolerance). Fresh random inputs per run (THINKV_TEST_SEED pins them, see tests/unit/
// test_util.hpp); the output is poisoned (0x7F bytes) before every launch. Many segments of
// different n, K and seeds share one launch, or are split into launches by size class with
// segment_ids and small shared-memory layouts (as CudaKvBackend runs them). Inputs: Gaussian
// points, exact duplicates, all points identical (zero distances, the k-means++ fallback),
// key-like points with a few large channels, points on a {-1, 0, 1} grid (many exactly tied
// distances), overflowing and non-finite values; points at 16-byte-aligned addresses (the kernel's
// float4 loads) and unaligned ones (a float at a time). THINKV_TEST_SMALL (set by
// bench/run_gpu_suite.sh under compute-sanitizer) keeps only small segments. Without a GPU the
// binary prints the skip message and exits 77 (catch_main.cpp).

#include <catch2/catch.hpp>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "../unit/test_util.hpp"
#include "cuda_check.hpp"
#include "thinkv/kernels/kmeans_kernels.hpp"
#include "thinkv/tbe/kmeans.hpp"

namespace {

namespace tk = thinkv::kernels;

template <typename T>
struct DeviceArray {
  T* ptr = nullptr;
  std::size_t count = 0;
  explicit DeviceArray(std::size_t n) : count(n) {
    CHECK_CUDA(cudaMalloc(&ptr, std::max<std::size_t>(n, 1) * sizeof(T)));
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() { (void)cudaFree(ptr); }
  void put(const std::vector<T>& h) {
    CHECK_CUDA(cudaMemcpy(ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> get() const {
    std::vector<T> h(count);
    CHECK_CUDA(cudaMemcpy(h.data(), ptr, count * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

enum class Data { kGauss, kDuplicates, kIdentical, kHeavy, kGrid, kExtreme };

const char* name_of(Data d) {
  switch (d) {
    case Data::kGauss: return "gauss";
    case Data::kDuplicates: return "duplicates";
    case Data::kIdentical: return "identical";
    case Data::kHeavy: return "heavy";
    case Data::kGrid: return "grid";
    case Data::kExtreme: return "extreme";
  }
  return "?";
}

struct Seg {
  int n = 0;
  int k = 0;
  std::uint64_t seed = 0;
};

/// One launch: segments of head_dim d in rows of max_points, output rows of max_k.
struct Batch {
  int d = 128;
  int max_points = tk::kKmeansMaxPoints;
  int max_k = tk::kKmeansMaxK;
  int iterations = thinkv::KmeansOptions{}.max_iterations;
  bool shared_seed = false;  // seeds == nullptr: every segment uses one seed
  std::uint64_t seed = thinkv::KmeansOptions{}.seed;
  std::vector<Seg> segs;
  std::vector<float> points;  // [segs, max_points, d]
  int offset = 0;             // floats between the allocation and `points` on the device (alignment)
};

std::uint64_t draw_seed(std::mt19937_64& rng) { return rng(); }

/// The edge grid of (n, K): n in {1, 2, K-1, K, K+1, 37, max_points} for K in ks (K >= n
/// included), plus `extra` random (n, K).
void add_grid(Batch& b, const std::vector<int>& ks, int n_cap, int extra, std::mt19937_64& rng) {
  for (int k : ks) {
    if (k > b.max_k) continue;
    for (int n : {1, 2, k - 1, k, k + 1, 37, b.max_points}) {
      if (n < 1 || n > b.max_points || n > n_cap) continue;
      b.segs.push_back({n, k, draw_seed(rng)});
    }
  }
  for (int e = 0; e < extra; ++e) {
    b.segs.push_back(
        {tt::uniform_int(rng, 1, std::min(n_cap, b.max_points)), tt::uniform_int(rng, 1, b.max_k), draw_seed(rng)});
  }
}

/// Fills every segment's n rows (rows >= n stay NaN: the kernel must not read them).
void fill_points(Batch& b, Data data, std::mt19937_64& rng) {
  const int d = b.d;
  b.points.assign(b.segs.size() * static_cast<std::size_t>(b.max_points) * d, std::numeric_limits<float>::quiet_NaN());
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::student_t_distribution<float> heavy_tail(3.0f);
  for (std::size_t s = 0; s < b.segs.size(); ++s) {
    float* x = b.points.data() + s * static_cast<std::size_t>(b.max_points) * d;
    const int n = std::min(b.segs[s].n, b.max_points);
    // A few distinct rows for the duplicate / identical kinds, and the heavy channels.
    std::vector<float> pool(static_cast<std::size_t>(4) * d);
    for (auto& v : pool) v = nd(rng);
    std::vector<float> channel_scale(static_cast<std::size_t>(d), 1.0f),
        channel_bias(static_cast<std::size_t>(d), 0.0f);
    for (int c = 0; c < std::max(1, d / 32); ++c) {
      const int j = tt::uniform_int(rng, 0, d - 1);
      channel_scale[static_cast<std::size_t>(j)] = 20.0f + 30.0f * static_cast<float>(tt::uniform01(rng));
      channel_bias[static_cast<std::size_t>(j)] = 10.0f * nd(rng);
    }
    const int distinct = tt::uniform_int(rng, 1, 4);
    for (int i = 0; i < n; ++i) {
      float* row = x + static_cast<std::size_t>(i) * d;
      const int pick = tt::uniform_int(rng, 0, distinct - 1);
      for (int j = 0; j < d; ++j) {
        float v = 0.0f;
        switch (data) {
          case Data::kGauss: v = nd(rng); break;
          case Data::kDuplicates: v = pool[static_cast<std::size_t>(pick) * d + j]; break;
          case Data::kIdentical: v = pool[static_cast<std::size_t>(j)]; break;
          case Data::kHeavy:
            v = heavy_tail(rng) * channel_scale[static_cast<std::size_t>(j)] +
                channel_bias[static_cast<std::size_t>(j)];
            break;
          case Data::kGrid: v = static_cast<float>(tt::uniform_int(rng, -1, 1)); break;
          case Data::kExtreme: {
            const int r = tt::uniform_int(rng, 0, 63);
            v = nd(rng);
            if (r == 0) v = std::numeric_limits<float>::infinity();
            if (r == 1) v = -std::numeric_limits<float>::infinity();
            if (r == 2) v = std::numeric_limits<float>::quiet_NaN();
            if (r >= 3 && r < 12) v *= 3e37f;  // squared distances overflow to +inf
            break;
          }
        }
        row[j] = v;
      }
      // Duplicates: also copy an earlier row exactly, now and then.
      if (data == Data::kDuplicates && i > 0 && tt::chance(rng, 0.3)) {
        std::memcpy(row, x + static_cast<std::size_t>(tt::uniform_int(rng, 0, i - 1)) * d,
                    static_cast<std::size_t>(d) * sizeof(float));
      }
    }
  }
}

/// One launch of a batch: the segments its CTAs select for (segment_ids) and its shared-memory
/// layout (0: max_points / max_k).
struct Launch {
  std::vector<int> ids;
  int layout_points = 0;
  int layout_k = 0;
};

constexpr int kPoison = 0x7F7F7F7F;  // an output int after the 0x7F poison

/// The CPU's row for one segment: kmeans_select's indices, then -1 up to max_k; all -1 for a
/// segment the kernel documents as invalid, or beyond the layout of the launch running it
/// (`layout_points`, `layout_k` resolved: 0 is not passed here).
std::vector<int> expected_row(const Batch& b, std::size_t s, int layout_points, int layout_k) {
  std::vector<int> row(static_cast<std::size_t>(b.max_k), -1);
  const Seg& sg = b.segs[s];
  if (sg.n < 1 || sg.n > b.max_points || sg.k < 1 || sg.k > b.max_k) return row;
  if (sg.n > layout_points || sg.k > layout_k) return row;
  thinkv::KmeansOptions o;
  o.max_iterations = b.iterations;
  o.seed = b.shared_seed ? b.seed : sg.seed;
  const std::vector<int> kept =
      thinkv::kmeans_select(b.points.data() + s * static_cast<std::size_t>(b.max_points) * b.d, sg.n, b.d, sg.k, o);
  std::copy(kept.begin(), kept.end(), row.begin());
  return row;
}

tk::KmeansSelectParams params_for(const Batch& b) {
  tk::KmeansSelectParams p;
  p.num_segments = static_cast<int>(b.segs.size());
  p.max_points = b.max_points;
  p.head_dim = b.d;
  p.max_k = b.max_k;
  p.max_iterations = b.iterations;
  p.seed = b.seed;
  return p;
}

/// Launches the batch (once, or as `launches`: one launch each, in one stream) and compares every
/// output row with the CPU; a row no launch names must keep its poison. Returns the number of
/// segments whose row differs (the first few are described through Catch's UNSCOPED_INFO).
int run_batch(const Batch& b, const char* what, const std::vector<Launch>& launches = {}) {
  const std::size_t S = b.segs.size();
  std::vector<int> n(S), k(S);
  std::vector<std::uint64_t> seeds(S);
  for (std::size_t s = 0; s < S; ++s) {
    n[s] = b.segs[s].n;
    k[s] = b.segs[s].k;
    seeds[s] = b.segs[s].seed;
  }
  DeviceArray<float> d_points(b.points.size() + static_cast<std::size_t>(b.offset));
  DeviceArray<int> d_n(S), d_k(S), d_kept(S * static_cast<std::size_t>(b.max_k));
  DeviceArray<std::uint64_t> d_seeds(S);
  CHECK_CUDA(
      cudaMemcpy(d_points.ptr + b.offset, b.points.data(), b.points.size() * sizeof(float), cudaMemcpyHostToDevice));
  d_n.put(n);
  d_k.put(k);
  d_seeds.put(seeds);
  CHECK_CUDA(cudaMemset(d_kept.ptr, 0x7F, d_kept.count * sizeof(int)));  // poison
  tk::KmeansSelectParams p = params_for(b);
  p.points = d_points.ptr + b.offset;
  p.num_points = d_n.ptr;
  p.k = d_k.ptr;
  p.seeds = b.shared_seed ? nullptr : d_seeds.ptr;
  p.kept = d_kept.ptr;
  // Each segment's resolved layout (the launch naming it; none: -1, the row stays poisoned).
  std::vector<int> lay_n(S, -1), lay_k(S, -1);
  if (launches.empty()) {
    std::fill(lay_n.begin(), lay_n.end(), b.max_points);
    std::fill(lay_k.begin(), lay_k.end(), b.max_k);
    REQUIRE(tk::launch_kmeans_select(p, nullptr) == cudaSuccess);
  } else {
    std::vector<int> all_ids;
    for (const Launch& l : launches) all_ids.insert(all_ids.end(), l.ids.begin(), l.ids.end());
    DeviceArray<int> d_ids(all_ids.size());
    d_ids.put(all_ids);
    std::size_t at = 0;
    for (const Launch& l : launches) {
      tk::KmeansSelectParams q = p;
      q.num_segments = static_cast<int>(l.ids.size());
      q.segment_ids = d_ids.ptr + at;
      q.layout_points = l.layout_points;
      q.layout_k = l.layout_k;
      at += l.ids.size();
      REQUIRE(tk::launch_kmeans_select(q, nullptr) == cudaSuccess);
      for (int id : l.ids) {
        if (id < 0) continue;
        REQUIRE(lay_n[static_cast<std::size_t>(id)] < 0);  // every segment in one launch at most
        lay_n[static_cast<std::size_t>(id)] = l.layout_points != 0 ? l.layout_points : b.max_points;
        lay_k[static_cast<std::size_t>(id)] = l.layout_k != 0 ? l.layout_k : b.max_k;
      }
    }
    CHECK_CUDA(cudaDeviceSynchronize());  // before d_ids goes
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  const std::vector<int> got = d_kept.get();
  int bad_segments = 0;
  for (std::size_t s = 0; s < S; ++s) {
    const std::vector<int> want = lay_n[s] < 0 ? std::vector<int>(static_cast<std::size_t>(b.max_k), kPoison)
                                               : expected_row(b, s, lay_n[s], lay_k[s]);
    const int* g = got.data() + s * static_cast<std::size_t>(b.max_k);
    if (std::equal(want.begin(), want.end(), g)) continue;
    if (++bad_segments <= 3) {
      std::string gs, ws;
      for (int t = 0; t < b.max_k; ++t) {
        gs += " " + std::to_string(g[t]);
        ws += " " + std::to_string(want[static_cast<std::size_t>(t)]);
      }
      UNSCOPED_INFO(what << " d=" << b.d << " segment " << s << " n=" << b.segs[s].n << " k=" << b.segs[s].k
                         << " iterations=" << b.iterations << "\n  gpu:" << gs << "\n  cpu:" << ws);
    }
  }
  std::printf("%s %-10s d=%3d segments=%4zu max_points=%3d max_k=%2d iterations=%2d launches=%zu: %d rows differ\n",
              bad_segments ? "FAIL" : "ok  ", what, b.d, S, b.max_points, b.max_k, b.iterations,
              std::max<std::size_t>(launches.size(), 1), bad_segments);
  return bad_segments;
}

/// The size-class split CudaKvBackend::launch_selection runs: one launch per non-empty
/// kmeans_size_class of n, its ids in random order, its layout the class's largest n and k
/// (segments with an invalid n or k are left out: no launch names them).
std::vector<Launch> class_launches(const Batch& b, std::mt19937_64& rng) {
  std::vector<Launch> out;
  for (int cls : {tk::kKmeansMaxPoints, 64, 32}) {
    Launch l;
    for (std::size_t s = 0; s < b.segs.size(); ++s) {
      const Seg& sg = b.segs[s];
      if (sg.n < 1 || sg.n > b.max_points || sg.k < 1 || sg.k > b.max_k || tk::kmeans_size_class(sg.n) != cls) {
        continue;
      }
      l.ids.push_back(static_cast<int>(s));
      l.layout_points = std::max(l.layout_points, sg.n);
      l.layout_k = std::max(l.layout_k, sg.k);
    }
    if (l.ids.empty()) continue;
    std::shuffle(l.ids.begin(), l.ids.end(), rng);
    out.push_back(std::move(l));
  }
  return out;
}

const std::vector<int> kAllK = {1, 4, 8, 16, 32, 64};

}  // namespace

TEST_CASE("kmeans kernel equals kmeans_select: Gaussian points, (n, K) edges, every head_dim", "[gpu][kmeans]") {
  TT_SEEDED_RNG();
  const bool small = tt::small_run();
  for (int d : {8, 32, 64, 128, 256}) {
    Batch b;
    b.d = d;
    const bool big_d = d >= 128;
    add_grid(b, small && big_d ? std::vector<int>{1, 4, 8} : kAllK, small ? (big_d ? 37 : 64) : 128, small ? 2 : 12,
             rng);
    fill_points(b, Data::kGauss, rng);
    CHECK(run_batch(b, name_of(Data::kGauss)) == 0);
  }
}

TEST_CASE("kmeans kernel equals kmeans_select: points not 16-byte aligned (read a float at a time)", "[gpu][kmeans]") {
  TT_SEEDED_RNG();
  for (int d : {8, 128}) {
    for (int offset : {1, 3}) {
      Batch b;
      b.d = d;
      b.offset = offset;
      add_grid(b, {1, 4, 16, 64}, 128, 4, rng);
      fill_points(b, Data::kGauss, rng);
      CHECK(run_batch(b, offset == 1 ? "offset 1" : "offset 3") == 0);
    }
  }
}

TEST_CASE("kmeans kernel equals kmeans_select: duplicates, identical points, grid ties", "[gpu][kmeans]") {
  TT_SEEDED_RNG();
  const bool small = tt::small_run();
  for (Data data : {Data::kDuplicates, Data::kIdentical, Data::kGrid}) {
    for (int d : {8, 32, 64, 128}) {
      if (small && d == 128) continue;
      Batch b;
      b.d = d;
      add_grid(b, small ? std::vector<int>{1, 4, 16} : kAllK, small ? 64 : 128, small ? 2 : 8, rng);
      fill_points(b, data, rng);
      CHECK(run_batch(b, name_of(data)) == 0);
    }
  }
}

TEST_CASE("kmeans kernel equals kmeans_select: key-like points with large channels", "[gpu][kmeans]") {
  TT_SEEDED_RNG();
  const bool small = tt::small_run();
  for (int d : {64, 128, 256}) {
    Batch b;
    b.d = d;
    if (small) {
      add_grid(b, {4, 8}, 37, 2, rng);
    } else {
      // Eviction-shaped: full segments (n = 128) shrinking to retention levels.
      for (int k : {4, 8, 16, 32, 64}) {
        for (int r = 0; r < 3; ++r) b.segs.push_back({128, k, draw_seed(rng)});
      }
      add_grid(b, {16, 64}, 128, 4, rng);
    }
    fill_points(b, Data::kHeavy, rng);
    CHECK(run_batch(b, name_of(Data::kHeavy)) == 0);
  }
}

TEST_CASE("kmeans kernel equals kmeans_select: overflowing and non-finite inputs", "[gpu][kmeans]") {
  TT_SEEDED_RNG();
  const bool small = tt::small_run();
  for (int d : {8, 64}) {
    Batch b;
    b.d = d;
    add_grid(b, small ? std::vector<int>{1, 4, 16} : kAllK, small ? 64 : 128, small ? 2 : 8, rng);
    fill_points(b, Data::kExtreme, rng);
    CHECK(run_batch(b, name_of(Data::kExtreme)) == 0);
  }
}

TEST_CASE("kmeans kernel equals kmeans_select: row capacity, max_k, iterations, shared seed", "[gpu][kmeans]") {
  TT_SEEDED_RNG();
  const bool small = tt::small_run();
  struct Shape {
    int d, max_points, max_k, iterations;
    bool shared_seed;
  };
  const Shape shapes[] = {
      {64, 40, 16, 10, false},                           // row stride 64 (not 128), narrow output rows
      {8, 33, 64, 3, true},                              // odd capacity, one seed for all segments
      {128, 100, 32, 0, false},                          // no Lloyd iteration: k-means++ centres select directly
      {8, 128, 64, 1, false},   {64, 96, 24, 50, true},  // run to convergence
      {256, 64, 8, 10, false},
  };
  for (const Shape& sh : shapes) {
    if (small && sh.d >= 128) continue;
    Batch b;
    b.d = sh.d;
    b.max_points = sh.max_points;
    b.max_k = sh.max_k;
    b.iterations = sh.iterations;
    b.shared_seed = sh.shared_seed;
    b.seed = draw_seed(rng);
    add_grid(b, {1, 4, 8, 16, 24, 32, 64}, small ? 40 : sh.max_points, small ? 2 : 10, rng);
    fill_points(b, tt::chance(rng, 0.5) ? Data::kGauss : Data::kGrid, rng);
    CHECK(run_batch(b, "shapes") == 0);
  }
}

TEST_CASE("kmeans kernel: many segments in one launch", "[gpu][kmeans]") {
  TT_SEEDED_RNG();
  const bool small = tt::small_run();
  Batch b;
  b.d = 128;
  const int segments = small ? 24 : 192;
  for (int s = 0; s < segments; ++s) {
    const int n = small ? tt::uniform_int(rng, 1, 40) : (tt::chance(rng, 0.7) ? 128 : tt::uniform_int(rng, 1, 128));
    const int k = small ? tt::uniform_int(rng, 1, 8)
                        : std::vector<int>{4, 8, 16, 32, 64}[static_cast<std::size_t>(tt::uniform_int(rng, 0, 4))];
    b.segs.push_back({n, k, draw_seed(rng)});
  }
  fill_points(b, tt::chance(rng, 0.5) ? Data::kHeavy : Data::kGauss, rng);
  CHECK(run_batch(b, "batch") == 0);
}

TEST_CASE("kmeans kernel: size-class launches (segment_ids, small layouts) equal kmeans_select", "[gpu][kmeans]") {
  TT_SEEDED_RNG();
  const bool small = tt::small_run();
  const Data kinds[] = {Data::kGauss, Data::kHeavy, Data::kGrid, Data::kDuplicates, Data::kExtreme};
  for (int d : {128, 8, 64, 256}) {
    if (small && d >= 128) continue;
    Batch b;
    b.d = d;
    // A decode step's selections (128 -> 64 ... 8 -> 4), random (n, K) over 4..128 points and
    // 1..64 centres (K >= n keeps all), and n at the class edges 32 / 33, 64 / 65.
    // THINKV_TEST_SMALL: 64 points at most but at head_dim 8 (two classes).
    const int n_max = small && d > 8 ? 64 : 128;
    const int random_segments = small ? 12 : 96;
    for (int n = n_max; n >= 8; n /= 2) {
      for (int r = 0; r < (small ? 1 : 4); ++r) b.segs.push_back({n, n / 2, draw_seed(rng)});
    }
    for (int e = 0; e < random_segments; ++e) {
      b.segs.push_back({tt::uniform_int(rng, 4, n_max), tt::uniform_int(rng, 1, 64), draw_seed(rng)});
    }
    for (int n : {32, 33, 64, 65}) {
      if (n <= n_max) b.segs.push_back({n, tt::uniform_int(rng, 1, n - 1), draw_seed(rng)});
    }
    std::shuffle(b.segs.begin(), b.segs.end(), rng);
    const Data data = kinds[tt::uniform_int(rng, 0, 4)];
    fill_points(b, data, rng);
    const std::vector<Launch> launches = class_launches(b, rng);
    CHECK(launches.size() == (n_max > 64 ? 3u : 2u));
    CHECK(run_batch(b, name_of(data), launches) == 0);
  }
}

TEST_CASE("kmeans kernel: segment_ids as a permutation, in one launch or two", "[gpu][kmeans]") {
  TT_SEEDED_RNG();
  const bool small = tt::small_run();
  Batch b;
  b.d = small ? 32 : 128;
  b.max_points = 100;  // rows of 100 points, output rows of 40
  b.max_k = 40;
  add_grid(b, {1, 4, 16, 40}, small ? 40 : 100, small ? 4 : 24, rng);
  fill_points(b, Data::kGauss, rng);
  Launch all;
  for (std::size_t s = 0; s < b.segs.size(); ++s) all.ids.push_back(static_cast<int>(s));
  std::shuffle(all.ids.begin(), all.ids.end(), rng);
  CHECK(run_batch(b, "permuted", {all}) == 0);  // the default layout: max_points, max_k
  // The same permutation cut in two launches, each sized for max_points and max_k explicitly.
  const auto half = static_cast<std::ptrdiff_t>(all.ids.size() / 2);
  Launch first{std::vector<int>(all.ids.begin(), all.ids.begin() + half), b.max_points, b.max_k};
  Launch second{std::vector<int>(all.ids.begin() + half, all.ids.end()), b.max_points, b.max_k};
  CHECK(run_batch(b, "permuted2", {first, second}) == 0);
}

TEST_CASE("kmeans kernel: a segment beyond its launch's layout gets an all -1 row, unnamed rows stay untouched",
          "[gpu][kmeans]") {
  TT_SEEDED_RNG();
  Batch b;
  b.d = 64;
  b.max_points = 128;
  b.max_k = 64;
  // Launched with a layout of 32 points and 16 centres: 0, 2, 5, 7 fit (5 keeps all: K >= n);
  // 1 (n 40), 3 (n 33), 4 (K 20) and 6 (K 17 >= n, keep-all but over layout_k) do not; 8 and 9
  // are in no launch (their rows keep the poison), and a negative id is skipped.
  b.segs = {{20, 4, 0},  {40, 8, 0},  {32, 16, 0}, {33, 4, 0},   {30, 20, 0},
            {12, 16, 0}, {10, 17, 0}, {32, 1, 0},  {128, 64, 0}, {16, 8, 0}};
  for (auto& s : b.segs) s.seed = draw_seed(rng);
  fill_points(b, Data::kGauss, rng);
  CHECK(run_batch(b, "layout", {Launch{{3, 0, -1, 6, 1, 2, 5, 4, 7}, 32, 16}}) == 0);
  // Within the layout (32 points, 64 centres), the same segments select as the CPU does.
  CHECK(run_batch(b, "layout64", {Launch{{0, 2, 5, 6, 7}, 32, 64}, Launch{{9}, 16, 8}}) == 0);
}

TEST_CASE("kmeans kernel: invalid device rows are all -1, the others unaffected", "[gpu][kmeans]") {
  TT_SEEDED_RNG();
  Batch b;
  b.d = 64;
  b.max_points = 50;
  b.max_k = 20;
  b.segs = {{0, 4, 1},   {51, 4, 2}, {20, 0, 3},  {20, 21, 4}, {-7, 2, 5},
            {20, -1, 6}, {20, 5, 7}, {50, 20, 8}, {3, 20, 9},  {1, 1, 10}};
  for (auto& s : b.segs) s.seed = draw_seed(rng);
  fill_points(b, Data::kGauss, rng);
  CHECK(run_batch(b, "invalid") == 0);  // expected_row gives -1 rows for the invalid ones
}

TEST_CASE("kmeans kernel: check_kmeans_select refuses bad parameters, nothing is launched", "[gpu][kmeans]") {
  const int S = 4;
  DeviceArray<float> pts(static_cast<std::size_t>(S) * 128 * 256);
  DeviceArray<int> n(S), k(S), kept(static_cast<std::size_t>(S) * 64);
  CHECK_CUDA(cudaMemset(pts.ptr, 0, pts.count * sizeof(float)));
  n.put(std::vector<int>(S, 10));
  k.put(std::vector<int>(S, 3));
  tk::KmeansSelectParams good;
  good.num_segments = S;
  good.points = pts.ptr;
  good.num_points = n.ptr;
  good.k = k.ptr;
  good.kept = kept.ptr;
  REQUIRE(tk::check_kmeans_select(good) == cudaSuccess);
  REQUIRE(tk::kmeans_select_shared_bytes(good) > 0);
  {
    tk::KmeansSelectParams big = good;
    big.head_dim = 256;
    // The largest shape fits the 227 KiB a CTA may opt into on sm_90.
    CHECK(tk::kmeans_select_shared_bytes(big) <= 227u * 1024u);
  }
  {
    // A small layout: 32 points and 16 centres at head_dim 128 take ~27 KiB (8 CTAs per SM).
    tk::KmeansSelectParams small = good;
    small.layout_points = 32;
    small.layout_k = 16;
    REQUIRE(tk::check_kmeans_select(small) == cudaSuccess);
    CHECK(tk::kmeans_select_shared_bytes(small) <= 28u * 1024u);
    CHECK(tk::kmeans_select_shared_bytes(small) < tk::kmeans_select_shared_bytes(good) / 3);
  }

  std::vector<std::pair<const char*, tk::KmeansSelectParams>> bad;
  auto with = [&](const char* what, auto edit) {
    tk::KmeansSelectParams p = good;
    edit(p);
    bad.emplace_back(what, p);
  };
  with("null points", [](auto& p) { p.points = nullptr; });
  with("null num_points", [](auto& p) { p.num_points = nullptr; });
  with("null k", [](auto& p) { p.k = nullptr; });
  with("null kept", [](auto& p) { p.kept = nullptr; });
  with("head_dim 0", [](auto& p) { p.head_dim = 0; });
  with("head_dim 7", [](auto& p) { p.head_dim = 7; });
  with("head_dim 16", [](auto& p) { p.head_dim = 16; });
  with("head_dim 48", [](auto& p) { p.head_dim = 48; });
  with("head_dim 512", [](auto& p) { p.head_dim = 512; });
  with("max_points 0", [](auto& p) { p.max_points = 0; });
  with("max_points 129", [](auto& p) { p.max_points = 129; });
  with("max_k 0", [](auto& p) { p.max_k = 0; });
  with("max_k 65", [](auto& p) { p.max_k = 65; });
  with("max_iterations -1", [](auto& p) { p.max_iterations = -1; });
  with("num_segments -1", [](auto& p) { p.num_segments = -1; });
  with("layout_points -1", [](auto& p) { p.layout_points = -1; });
  with("layout_points above max_points", [](auto& p) {
    p.max_points = 40;
    p.layout_points = 41;
  });
  with("layout_k -1", [](auto& p) { p.layout_k = -1; });
  with("layout_k above max_k", [](auto& p) {
    p.max_k = 8;
    p.layout_k = 9;
  });
  for (const auto& [what, p] : bad) {
    INFO(what);
    CHECK(tk::check_kmeans_select(p) == cudaErrorInvalidValue);
    CHECK(tk::kmeans_select_shared_bytes(p) == 0);
    CHECK_CUDA(cudaMemset(kept.ptr, 0x7F, kept.count * sizeof(int)));
    CHECK(tk::launch_kmeans_select(p, nullptr) == cudaErrorInvalidValue);
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK(cudaGetLastError() == cudaSuccess);
    const std::vector<int> h = kept.get();
    CHECK(std::all_of(h.begin(), h.end(), [](int v) { return v == 0x7F7F7F7F; }));
  }
  // No segments: nothing to do, null pointers allowed.
  tk::KmeansSelectParams none;
  none.num_segments = 0;
  CHECK(tk::check_kmeans_select(none) == cudaSuccess);
  CHECK(tk::launch_kmeans_select(none, nullptr) == cudaSuccess);
  // The good parameters do launch (k = 3 < n = 10: three indices, then -1).
  CHECK_CUDA(cudaMemset(kept.ptr, 0x7F, kept.count * sizeof(int)));
  REQUIRE(tk::launch_kmeans_select(good, nullptr) == cudaSuccess);
  CHECK_CUDA(cudaDeviceSynchronize());
  const std::vector<int> h = kept.get();
  for (int s = 0; s < S; ++s) {
    for (int t = 0; t < 64; ++t) {
      const int v = h[static_cast<std::size_t>(s) * 64 + t];
      if (t < 3) {
        CHECK((v >= 0 && v < 10));
      } else {
        CHECK(v == -1);
      }
    }
  }
}
