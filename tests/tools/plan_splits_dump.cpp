// plan_decode_splits_for_length (include/thinkv/kernels/launch_plan.hpp) over a grid of launches,
// one line per launch, for `python3 bench/tools/split_sweep.py --check-plan`: the tool's Python
// model of the plan (which it fits to measurements) must choose what the C++ plan chooses.
//   plan_splits_dump PIECE
// First line: "constants <kSplitStartupHalfPieces> <kSplitMergeHalfPieces>"; then per launch
// "sms ctas_per_sm max_splits kv_heads positions merge splits".
#include <cstdio>
#include <cstdlib>
#include <initializer_list>

#include "thinkv/kernels/launch_plan.hpp"

int main(int argc, char** argv) {
  using thinkv::kernels::kSplitMergeHalfPieces;
  using thinkv::kernels::kSplitStartupHalfPieces;
  using thinkv::kernels::plan_decode_splits_for_length;
  const long long piece = argc == 2 ? std::atoll(argv[1]) : 0;
  if (piece < 1) {
    std::fprintf(stderr, "usage: plan_splits_dump PIECE (positions per chunk piece, >= 1)\n");
    return 2;
  }
  std::printf("constants %lld %lld\n", kSplitStartupHalfPieces, kSplitMergeHalfPieces);
  for (int sms : {132, 114, 7}) {
    for (int per_sm : {1, 2, 3, 4}) {
      for (int max_splits : {1, 4, 256}) {
        for (int hkv : {1, 8, 64, 255, 256, 512, 2048}) {
          for (long long positions : {1LL, 127LL, 128LL, 129LL, 512LL, 1024LL, 2048LL, 4096LL, 8192LL, 32768LL}) {
            for (long long merge : {0LL, kSplitMergeHalfPieces}) {
              const int s = plan_decode_splits_for_length(hkv, static_cast<long long>(sms) * per_sm, max_splits,
                                                          positions, piece, merge);
              std::printf("%d %d %d %d %lld %lld %d\n", sms, per_sm, max_splits, hkv, positions, merge, s);
            }
          }
        }
      }
    }
  }
  return 0;
}
