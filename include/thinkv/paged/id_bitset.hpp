#pragma once
/// \file id_bitset.hpp
/// A set of ids in [0, universe) as a two-level bitmap: a bit per id, and a bit per 64-id word
/// that says whether the word holds any. Insert and erase are O(1) and never allocate; the
/// smallest id at or after a given one is found by skipping empty words 64 at a time. BlockTable
/// keeps each pool's free blocks in one (lowest id first), where a node-based std::set cost an
/// allocation and a tree walk per block taken or returned.

#include <bit>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace thinkv {

class IdBitset {
 public:
  static constexpr std::uint32_t kNone = 0xFFFFFFFFu;

  /// Ids [0, n) may be held; ids >= n are removed. New ids start absent.
  void resize(std::uint32_t n) {
    const std::size_t words = (static_cast<std::size_t>(n) + 63) / 64;
    if (n < universe_) {  // drop the ids past n from the count
      for (std::uint32_t i = next(n); i != kNone; i = next(i + 1)) --size_;
    }
    words_.resize(words, 0);
    if (n % 64 != 0 && !words_.empty()) words_.back() &= (std::uint64_t{1} << (n % 64)) - 1;
    summary_.resize((words + 63) / 64, 0);
    if (!summary_.empty()) {  // the last summary word describes the words that remain
      const std::size_t s = summary_.size() - 1;
      std::uint64_t bits = 0;
      for (std::size_t w = s * 64; w < words; ++w) bits |= static_cast<std::uint64_t>(words_[w] != 0) << (w % 64);
      summary_[s] = bits;
    }
    universe_ = n;
  }
  /// Capacity for ids [0, n) without reallocation; the bytes the arrays then hold.
  std::int64_t reserve(std::uint32_t n) {
    const std::size_t words = (static_cast<std::size_t>(n) + 63) / 64;
    words_.reserve(words);
    summary_.reserve((words + 63) / 64);
    return static_cast<std::int64_t>((words_.capacity() + summary_.capacity()) * sizeof(std::uint64_t));
  }
  [[nodiscard]] std::uint32_t universe() const noexcept { return universe_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }

  [[nodiscard]] bool contains(std::uint32_t i) const noexcept {
    return i < universe_ && ((words_[i / 64] >> (i % 64)) & 1u) != 0;
  }
  /// Adds id i (< universe()); false when it was there already.
  bool insert(std::uint32_t i) noexcept {
    std::uint64_t& w = words_[i / 64];
    const std::uint64_t bit = std::uint64_t{1} << (i % 64);
    if ((w & bit) != 0) return false;
    w |= bit;
    summary_[i / 4096] |= std::uint64_t{1} << ((i / 64) % 64);
    ++size_;
    return true;
  }
  /// Removes id i; false when it was absent.
  bool erase(std::uint32_t i) noexcept {
    if (i >= universe_) return false;
    std::uint64_t& w = words_[i / 64];
    const std::uint64_t bit = std::uint64_t{1} << (i % 64);
    if ((w & bit) == 0) return false;
    w &= ~bit;
    if (w == 0) summary_[i / 4096] &= ~(std::uint64_t{1} << ((i / 64) % 64));
    --size_;
    return true;
  }
  /// The smallest held id >= i, or kNone.
  [[nodiscard]] std::uint32_t next(std::uint32_t i) const noexcept {
    if (i >= universe_) return kNone;
    std::size_t w = i / 64;
    if (const std::uint64_t bits = words_[w] & (~std::uint64_t{0} << (i % 64)); bits != 0) {
      return static_cast<std::uint32_t>(w * 64 + static_cast<std::size_t>(std::countr_zero(bits)));
    }
    ++w;  // the first non-empty word after w, through the summary
    for (std::size_t s = w / 64; s < summary_.size(); ++s) {
      std::uint64_t sb = summary_[s];
      if (s == w / 64) sb &= ~std::uint64_t{0} << (w % 64);
      if (sb != 0) {
        const std::size_t found = s * 64 + static_cast<std::size_t>(std::countr_zero(sb));
        return static_cast<std::uint32_t>(found * 64 + static_cast<std::size_t>(std::countr_zero(words_[found])));
      }
    }
    return kNone;
  }

 private:
  std::vector<std::uint64_t> words_;    // bit i % 64 of word i / 64: id i is held
  std::vector<std::uint64_t> summary_;  // bit w % 64 of word w / 64: words_[w] != 0
  std::uint32_t universe_ = 0;
  std::size_t size_ = 0;
};

}  // namespace thinkv
