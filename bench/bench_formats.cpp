// CPU throughput of the number formats: group quantization (quantize + pack) and dequantization
// (unpack + dequantize) per precision and group size, plus BF16 staging encode/decode.
// Bytes processed = bytes of FP32 data consumed (encode) or produced (decode), so the numbers of
// different precisions are directly comparable. Single-threaded reference code, not the kernels.

#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

#include "thinkv/formats.hpp"

namespace {

using thinkv::Precision;

constexpr int kElements = 1 << 16;  // 256 KiB of FP32 per iteration: fits in L2

std::vector<float> gaussian_data(int n) {
  std::mt19937 rng(12345);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(n));
  for (float& v : x) v = normal(rng);
  return x;
}

// Quantizes kElements floats as contiguous groups of g and packs the codes into rows.
template <Precision P>
void BM_QuantizeGroups(benchmark::State& state) {
  const int g = static_cast<int>(state.range(0));
  const std::vector<float> x = gaussian_data(kElements);
  const int groups = kElements / g;
  const float s2 = thinkv::choose_stream_scale(P, thinkv::group_amax(x.data(), 1, g));
  std::vector<std::uint8_t> packed(static_cast<std::size_t>(thinkv::packed_row_bytes(P, kElements)));
  std::vector<std::uint8_t> scales(static_cast<std::size_t>(groups));
  std::uint8_t codes[thinkv::kMaxGroupSize];
  for (auto _ : state) {
    for (int b = 0; b < groups; ++b) {
      scales[static_cast<std::size_t>(b)] = thinkv::quantize_group(P, x.data() + b * g, 1, g, s2, codes, 1);
      for (int i = 0; i < g; ++i) thinkv::store_code(P, packed.data(), b * g + i, codes[i]);
    }
    benchmark::DoNotOptimize(packed.data());
    benchmark::DoNotOptimize(scales.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(kElements * sizeof(float)));
  state.SetItemsProcessed(state.iterations() * kElements);
}

// Unpacks and dequantizes kElements elements (groups of g) back to FP32.
template <Precision P>
void BM_DequantizeGroups(benchmark::State& state) {
  const int g = static_cast<int>(state.range(0));
  const std::vector<float> x = gaussian_data(kElements);
  const int groups = kElements / g;
  const float s2 = thinkv::choose_stream_scale(P, thinkv::group_amax(x.data(), 1, g));
  std::vector<std::uint8_t> packed(static_cast<std::size_t>(thinkv::packed_row_bytes(P, kElements)));
  std::vector<std::uint8_t> scales(static_cast<std::size_t>(groups));
  std::uint8_t codes[thinkv::kMaxGroupSize];
  for (int b = 0; b < groups; ++b) {
    scales[static_cast<std::size_t>(b)] = thinkv::quantize_group(P, x.data() + b * g, 1, g, s2, codes, 1);
    for (int i = 0; i < g; ++i) thinkv::store_code(P, packed.data(), b * g + i, codes[i]);
  }
  std::vector<float> out(static_cast<std::size_t>(kElements));
  for (auto _ : state) {
    for (int b = 0; b < groups; ++b) {
      const std::uint8_t sc = scales[static_cast<std::size_t>(b)];
      for (int i = 0; i < g; ++i) {
        const int e = b * g + i;
        out[static_cast<std::size_t>(e)] = thinkv::dequantize(P, thinkv::load_code(P, packed.data(), e), sc, s2);
      }
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(kElements * sizeof(float)));
  state.SetItemsProcessed(state.iterations() * kElements);
}

void BM_EncodeBf16(benchmark::State& state) {
  const std::vector<float> x = gaussian_data(kElements);
  std::vector<std::uint16_t> out(static_cast<std::size_t>(kElements));
  for (auto _ : state) {
    for (std::size_t i = 0; i < x.size(); ++i) out[i] = thinkv::encode_bf16(x[i]);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(kElements * sizeof(float)));
  state.SetItemsProcessed(state.iterations() * kElements);
}

void BM_DecodeBf16(benchmark::State& state) {
  const std::vector<float> x = gaussian_data(kElements);
  std::vector<std::uint16_t> in(static_cast<std::size_t>(kElements));
  for (std::size_t i = 0; i < x.size(); ++i) in[i] = thinkv::encode_bf16(x[i]);
  std::vector<float> out(static_cast<std::size_t>(kElements));
  for (auto _ : state) {
    for (std::size_t i = 0; i < in.size(); ++i) out[i] = thinkv::decode_bf16(in[i]);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(kElements * sizeof(float)));
  state.SetItemsProcessed(state.iterations() * kElements);
}

}  // namespace

BENCHMARK_TEMPLATE(BM_QuantizeGroups, Precision::kFp8E4M3)->Arg(8)->Arg(16)->Arg(32);
BENCHMARK_TEMPLATE(BM_QuantizeGroups, Precision::kNvfp4)->Arg(8)->Arg(16)->Arg(32);
BENCHMARK_TEMPLATE(BM_QuantizeGroups, Precision::kTernary)->Arg(8)->Arg(16)->Arg(32);
BENCHMARK_TEMPLATE(BM_DequantizeGroups, Precision::kFp8E4M3)->Arg(8)->Arg(16)->Arg(32);
BENCHMARK_TEMPLATE(BM_DequantizeGroups, Precision::kNvfp4)->Arg(8)->Arg(16)->Arg(32);
BENCHMARK_TEMPLATE(BM_DequantizeGroups, Precision::kTernary)->Arg(8)->Arg(16)->Arg(32);
BENCHMARK(BM_EncodeBf16);
BENCHMARK(BM_DecodeBf16);
