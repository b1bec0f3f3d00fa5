#pragma once
/// \file tokenizer.hpp
/// llama2.c-style tokenizer: sentencepiece-like BPE encoding of a prompt (run.c's algorithm:
/// a dummy-prefix space, characters (UTF-8 code points) looked up as pieces with byte fallback
/// to <0xXX> tokens, then repeated merging of the adjacent pair whose merged piece has the best
/// score, leftmost on ties) and run.c's piece decoding (after BOS a leading space is stripped;
/// raw byte pieces like <0x0A> become the byte; lone non-printable bytes are not printed).
///
/// Sources: llama2.c's tokenizer.bin format (tok512.bin) and a GGUF's embedded
/// tokenizer.ggml.tokens/scores/token_type (sentencepiece "llama" model, where U+2581 stands for
/// a space).
///
/// A second kind, byte-level BPE (GGUF tokenizer.ggml.model "gpt2", e.g. Llama 3 and the
/// DeepSeek-R1 Llama distills), is supported too: pieces are bytes mapped to printable code
/// points (GPT-2's bytes_to_unicode), text is pre-split like Llama 3's pattern (contractions,
/// letter runs with one leading non-letter, 1-3 digits, punctuation runs, whitespace; non-ASCII
/// code points count as letters, an approximation of \p{L}), each chunk is merged by
/// tokenizer.ggml.merges rank, and special (control / user-defined) tokens in the text are
/// matched literally.
///
/// The merge loop uses a priority queue over a linked list instead of run.c's rescans, so long
/// prompts cost O(n log n) lookups instead of O(n^2); the result is the same (best score first,
/// leftmost pair on equal scores, a pair only merges when its score is above -1e10).

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <queue>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "thinkv/util/utf8.hpp"
#include "model_file.hpp"
#include "thinkv/status.hpp"

namespace thinkv::decoder {

enum class TokenizerKind : std::uint8_t { kSentencePiece, kByteBpe };

struct Tokenizer {
  TokenizerKind kind = TokenizerKind::kSentencePiece;
  std::vector<std::string> vocab;
  std::vector<std::string> merges;  ///< byte BPE: "left right", by rank (first = merged first)
  std::vector<float> scores;
  std::vector<std::int32_t> types;  ///< GGUF token types (1 normal, 2 unknown, 3 control, 6 byte), may be empty
  int bos_id = 1;
  int eos_id = 2;
  int unk_id = 0;
  std::string source;

  [[nodiscard]] int size() const noexcept { return static_cast<int>(vocab.size()); }

  /// Builds the lookup tables; call after filling vocab/scores.
  [[nodiscard]] Status finalize() {
    if (vocab.empty()) return {StatusCode::kInvalidArgument, source + ": the tokenizer has no tokens"};
    if (scores.size() != vocab.size()) {
      return {StatusCode::kInvalidArgument, source + ": " + std::to_string(vocab.size()) + " tokens but " +
                                                std::to_string(scores.size()) + " scores"};
    }
    // Every special id the encoder and decoder use must name a token (BOS and EOS default to
    // llama2.c's 1 and 2, so a vocabulary needs at least 3 tokens unless the file names others).
    for (const auto& [name, id] : {std::pair<const char*, int>{"BOS", bos_id}, {"EOS", eos_id}, {"unknown", unk_id}}) {
      if (id < 0 || id >= size()) {
        return {StatusCode::kInvalidArgument,
                source + ": the " + name + " token id " + std::to_string(id) + " is outside the vocabulary of " +
                    std::to_string(size()) + " token" + (size() == 1 ? "" : "s") +
                    " (llama2.c tokenizers need at least 3: <unk>, BOS, EOS); the tokenizer file is corrupt or "
                    "not for this model"};
      }
    }
    index_.clear();
    index_.reserve(vocab.size() * 2);
    for (std::size_t i = 0; i < vocab.size(); ++i) index_.emplace(vocab[i], static_cast<int>(i));
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof name, "<0x%02X>", b);
      const int id = lookup(name);
      byte_ids_[static_cast<std::size_t>(b)] = id >= 0 ? id : (b + 3 < size() ? b + 3 : unk_id);
    }
    space_id_ = lookup(" ");
    if (kind == TokenizerKind::kByteBpe) {
      build_byte_maps();
      merge_rank_.clear();
      merge_rank_.reserve(merges.size() * 2);
      for (std::size_t i = 0; i < merges.size(); ++i) merge_rank_.emplace(merges[i], static_cast<int>(i));
      specials_.clear();
      for (std::size_t i = 0; i < vocab.size() && i < types.size(); ++i) {
        if ((types[i] == 3 || types[i] == 4) && vocab[i].size() >= 2) specials_.push_back(static_cast<int>(i));
      }
      std::sort(specials_.begin(), specials_.end(), [&](int a, int b) {
        return vocab[static_cast<std::size_t>(a)].size() > vocab[static_cast<std::size_t>(b)].size();
      });
    }
    return Status::ok();
  }

  /// Id of a piece, or -1.
  [[nodiscard]] int lookup(std::string_view piece) const {
    const auto it = index_.find(std::string(piece));
    return it == index_.end() ? -1 : it->second;
  }

  /// Encodes text like run.c's encode(): optional BOS, a dummy-prefix space when text is not
  /// empty, code points (or their bytes), then score-ordered merges; optional EOS.
  [[nodiscard]] std::vector<int> encode(std::string_view text, bool bos, bool eos) const {
    if (kind == TokenizerKind::kByteBpe) return encode_byte_bpe(text, bos, eos);
    std::vector<int> toks;
    if (bos) toks.push_back(bos_id);
    if (!text.empty() && space_id_ >= 0) toks.push_back(space_id_);
    // Code points: a lead byte starts a new one; up to 4 bytes (run.c's rule).
    std::string buf;
    for (std::size_t i = 0; i < text.size(); ++i) {
      const auto c = static_cast<unsigned char>(text[i]);
      if ((c & 0xC0) != 0x80) buf.clear();
      buf += static_cast<char>(c);
      const bool next_is_cont = i + 1 < text.size() && (static_cast<unsigned char>(text[i + 1]) & 0xC0) == 0x80;
      if (next_is_cont && buf.size() < 4) continue;
      const int id = lookup(buf);
      if (id >= 0) {
        toks.push_back(id);
      } else {
        for (char b : buf) toks.push_back(byte_ids_[static_cast<unsigned char>(b)]);
      }
      buf.clear();
    }
    merge(toks);
    if (eos) toks.push_back(eos_id);
    return toks;
  }

  /// The text run.c prints for `token` following `prev` (decode() + safe_printf()).
  [[nodiscard]] std::string decode_piece(int prev, int token) const {
    if (token < 0 || token >= size()) return {};
    if (kind == TokenizerKind::kByteBpe) return decode_byte_bpe(token);
    std::string_view piece = vocab[static_cast<std::size_t>(token)];
    if (prev == bos_id && !piece.empty() && piece.front() == ' ') piece.remove_prefix(1);
    std::string out;
    int byte = -1;
    if (parse_byte_piece(piece, byte)) {
      out.assign(1, static_cast<char>(byte));
    } else {
      out.assign(piece);
    }
    if (out.size() == 1) {
      const auto b = static_cast<unsigned char>(out[0]);
      if (!(std::isprint(b) || std::isspace(b))) return {};  // a lone bad byte is not printed
    }
    return out;
  }

  /// Concatenated decode_piece over tokens; `prev` is the token before the first.
  [[nodiscard]] std::string decode(const std::vector<int>& tokens, int prev) const {
    std::string s;
    for (int t : tokens) {
      s += decode_piece(prev, t);
      prev = t;
    }
    return s;
  }

 private:
  static bool parse_byte_piece(std::string_view p, int& out) {
    // run.c uses sscanf(piece, "<0x%02hhX>"): "<0x" then one or two hex digits.
    if (p.size() < 4 || p.substr(0, 3) != "<0x") return false;
    int v = 0, n = 0;
    for (std::size_t i = 3; i < p.size() && n < 2; ++i, ++n) {
      const char c = p[i];
      int d = -1;
      if (c >= '0' && c <= '9')
        d = c - '0';
      else if (c >= 'a' && c <= 'f')
        d = c - 'a' + 10;
      else if (c >= 'A' && c <= 'F')
        d = c - 'A' + 10;
      if (d < 0) break;
      v = v * 16 + d;
    }
    if (n == 0) return false;
    out = v;
    return true;
  }

  /// Score-ordered pair merging over the whole list (BOS included, as in run.c; BOS's piece
  /// never forms a known pair in practice).
  void merge(std::vector<int>& toks) const {
    const std::size_t n = toks.size();
    if (n < 2) return;
    std::vector<int> prev(n), next(n), version(n, 0);
    std::vector<bool> alive(n, true);
    for (std::size_t i = 0; i < n; ++i) {
      prev[i] = static_cast<int>(i) - 1;
      next[i] = i + 1 < n ? static_cast<int>(i) + 1 : -1;
    }
    struct Cand {
      float score;
      int left, right, id, vl, vr;
    };
    auto worse = [](const Cand& a, const Cand& b) {  // max-heap: best score, then leftmost
      if (a.score != b.score) return a.score < b.score;
      return a.left > b.left;
    };
    std::priority_queue<Cand, std::vector<Cand>, decltype(worse)> heap(worse);
    std::string tmp;
    auto push = [&](int l) {
      if (l < 0) return;
      const int r = next[static_cast<std::size_t>(l)];
      if (r < 0) return;
      tmp = vocab[static_cast<std::size_t>(toks[static_cast<std::size_t>(l)])];
      tmp += vocab[static_cast<std::size_t>(toks[static_cast<std::size_t>(r)])];
      const int id = lookup(tmp);
      if (id < 0) return;
      const float s = scores[static_cast<std::size_t>(id)];
      if (!(s > -1e10f)) return;
      heap.push({s, l, r, id, version[static_cast<std::size_t>(l)], version[static_cast<std::size_t>(r)]});
    };
    for (std::size_t i = 0; i + 1 < n; ++i) push(static_cast<int>(i));
    while (!heap.empty()) {
      const Cand c = heap.top();
      heap.pop();
      const auto l = static_cast<std::size_t>(c.left), r = static_cast<std::size_t>(c.right);
      if (!alive[l] || !alive[r] || next[l] != c.right || version[l] != c.vl || version[r] != c.vr) continue;
      toks[l] = c.id;
      ++version[l];
      alive[r] = false;
      next[l] = next[r];
      if (next[r] >= 0) prev[static_cast<std::size_t>(next[r])] = c.left;
      push(prev[l]);
      push(c.left);
    }
    std::size_t w = 0;
    for (std::size_t i = 0; i < n; ++i) {
      if (alive[i]) toks[w++] = toks[i];
    }
    toks.resize(w);
  }

  // ---- byte-level BPE ----------------------------------------------------------------------

  /// Decodes one UTF-8 code point at s[i] (a stray byte is returned as itself); advances i.
  static std::uint32_t next_cp(std::string_view s, std::size_t& i) {
    const auto c = static_cast<unsigned char>(s[i]);
    int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    if (i + static_cast<std::size_t>(n) > s.size()) n = 1;
    std::uint32_t cp = n == 1 ? c : n == 2 ? (c & 0x1Fu) : n == 3 ? (c & 0x0Fu) : (c & 0x07u);
    for (int k = 1; k < n; ++k) {
      const auto d = static_cast<unsigned char>(s[i + static_cast<std::size_t>(k)]);
      if ((d & 0xC0) != 0x80) {
        n = 1;
        cp = c;
        break;
      }
      cp = (cp << 6) | (d & 0x3Fu);
    }
    i += static_cast<std::size_t>(n);
    return cp;
  }

  /// GPT-2's bytes_to_unicode: printable Latin-1 bytes map to themselves, the others to U+0100+.
  void build_byte_maps() {
    std::array<std::uint32_t, 256> cs{};
    std::array<bool, 256> direct{};
    for (int b = 0; b < 256; ++b)
      direct[static_cast<std::size_t>(b)] = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    std::uint32_t n = 0;
    for (int b = 0; b < 256; ++b)
      cs[static_cast<std::size_t>(b)] = direct[static_cast<std::size_t>(b)] ? static_cast<std::uint32_t>(b) : 256 + n++;
    unicode_to_byte_.clear();
    for (int b = 0; b < 256; ++b) {
      byte_to_piece_[static_cast<std::size_t>(b)].clear();
      ::thinkv::append_utf8(byte_to_piece_[static_cast<std::size_t>(b)], cs[static_cast<std::size_t>(b)]);
      unicode_to_byte_.emplace(cs[static_cast<std::size_t>(b)], static_cast<std::uint8_t>(b));
    }
  }

  [[nodiscard]] std::string decode_byte_bpe(int token) const {
    const std::string& piece = vocab[static_cast<std::size_t>(token)];
    const std::int32_t type =
        static_cast<std::size_t>(token) < types.size() ? types[static_cast<std::size_t>(token)] : 1;
    if (type == 3 || type == 4) return piece;  // control / user-defined: the text itself
    std::string out;
    for (std::size_t i = 0; i < piece.size();) {
      const std::size_t at = i;
      const std::uint32_t cp = next_cp(piece, i);
      const auto it = unicode_to_byte_.find(cp);
      if (it != unicode_to_byte_.end()) {
        out += static_cast<char>(it->second);
      } else {
        out.append(piece, at, i - at);  // not a byte-level piece: keep as is
      }
    }
    return out;
  }

  enum class Cls : std::uint8_t { kLetter, kDigit, kSpace, kNewline, kOther };
  static Cls cls(std::uint32_t cp) {
    if (cp == '\n' || cp == '\r') return Cls::kNewline;
    if (cp == ' ' || cp == '\t' || cp == '\v' || cp == '\f' || cp == 0x85 || cp == 0xA0 || cp == 0x3000 ||
        (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029) {
      return Cls::kSpace;
    }
    if ((cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z')) return Cls::kLetter;
    if (cp >= '0' && cp <= '9') return Cls::kDigit;
    if (cp < 0x80) return Cls::kOther;
    // Non-ASCII: general punctuation and symbol blocks count as "other", the rest as letters.
    if ((cp >= 0x2010 && cp <= 0x206F) || (cp >= 0x3000 && cp <= 0x303F) || (cp >= 0xFF00 && cp <= 0xFF0F) ||
        (cp >= 0xA1 && cp <= 0xBF) || cp == 0xD7 || cp == 0xF7) {
      return Cls::kOther;
    }
    return Cls::kLetter;
  }

  /// Splits text into pre-tokens following Llama 3's pattern (see the file comment).
  static std::vector<std::string_view> pre_split(std::string_view s) {
    std::vector<std::uint32_t> cps;
    std::vector<std::size_t> at;  // byte offset of each code point (+ end)
    for (std::size_t i = 0; i < s.size();) {
      at.push_back(i);
      cps.push_back(next_cp(s, i));
    }
    at.push_back(s.size());
    const std::size_t n = cps.size();
    auto C = [&](std::size_t k) { return cls(cps[k]); };
    auto is_ws = [&](std::size_t k) { return C(k) == Cls::kSpace || C(k) == Cls::kNewline; };
    std::vector<std::string_view> out;
    std::size_t i = 0;
    while (i < n) {
      std::size_t j = i;
      // 1. contractions 's 't 're 've 'm 'll 'd (any case)
      if (cps[i] == '\'' && i + 1 < n) {
        auto lower = [&](std::size_t k) {
          return cps[k] < 0x80 ? static_cast<std::uint32_t>(std::tolower(static_cast<int>(cps[k]))) : cps[k];
        };
        const std::uint32_t a = lower(i + 1), b = i + 2 < n ? lower(i + 2) : 0;
        if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l'))
          j = i + 3;
        else if (a == 's' || a == 't' || a == 'm' || a == 'd')
          j = i + 2;
      }
      // 2. [^\r\n\p{L}\p{N}]?\p{L}+
      if (j == i) {
        std::size_t k = i;
        if (C(k) != Cls::kNewline && C(k) != Cls::kLetter && C(k) != Cls::kDigit && k + 1 < n &&
            C(k + 1) == Cls::kLetter)
          ++k;
        if (C(k) == Cls::kLetter) {
          while (k < n && C(k) == Cls::kLetter) ++k;
          j = k;
        }
      }
      // 3. \p{N}{1,3}
      if (j == i && C(i) == Cls::kDigit) {
        while (j < n && j < i + 3 && C(j) == Cls::kDigit) ++j;
      }
      // 4. ' '?[^\s\p{L}\p{N}]+[\r\n]*
      if (j == i) {
        std::size_t k = i;
        if (cps[k] == ' ' && k + 1 < n && C(k + 1) == Cls::kOther) ++k;
        if (C(k) == Cls::kOther) {
          while (k < n && C(k) == Cls::kOther) ++k;
          while (k < n && C(k) == Cls::kNewline) ++k;
          j = k;
        }
      }
      // 5. \s*[\r\n]+   6. \s+(?!\S)   7. \s+
      if (j == i && is_ws(i)) {
        std::size_t e = i;
        while (e < n && is_ws(e)) ++e;
        std::size_t last_nl = n;
        for (std::size_t k = i; k < e; ++k) {
          if (C(k) == Cls::kNewline) last_nl = k;
        }
        if (last_nl != n) {
          j = last_nl + 1;
        } else if (e == n || e - i == 1) {
          j = e;
        } else {
          j = e - 1;  // leave one space to lead the next word
        }
      }
      if (j == i) j = i + 1;
      out.push_back(s.substr(at[i], at[j] - at[i]));
      i = j;
    }
    return out;
  }

  /// Merges one pre-token (already mapped to byte-level code points) by merge rank.
  void bpe_chunk(std::string_view chunk, std::vector<int>& out) const {
    std::vector<std::string> sym;
    for (unsigned char b : chunk) sym.push_back(byte_to_piece_[b]);
    std::string key;
    while (sym.size() > 1) {
      int best = -1;
      std::size_t best_i = 0;
      for (std::size_t i = 0; i + 1 < sym.size(); ++i) {
        key = sym[i];
        key += ' ';
        key += sym[i + 1];
        const auto it = merge_rank_.find(key);
        if (it != merge_rank_.end() && (best < 0 || it->second < best)) {
          best = it->second;
          best_i = i;
        }
      }
      if (best < 0) break;
      sym[best_i] += sym[best_i + 1];
      sym.erase(sym.begin() + static_cast<std::ptrdiff_t>(best_i) + 1);
    }
    for (const std::string& p : sym) {
      const int id = lookup(p);
      if (id >= 0) {
        out.push_back(id);
        continue;
      }
      for (std::size_t i = 0; i < p.size();) {  // no such piece: its bytes one by one
        const std::size_t a = i;
        next_cp(p, i);
        const int bid = lookup(p.substr(a, i - a));
        out.push_back(bid >= 0 ? bid : unk_id);
      }
    }
  }

  [[nodiscard]] std::vector<int> encode_byte_bpe(std::string_view text, bool bos, bool eos) const {
    std::vector<int> toks;
    if (bos) toks.push_back(bos_id);
    std::size_t start = 0;
    auto flush = [&](std::size_t end) {
      for (std::string_view chunk : pre_split(text.substr(start, end - start))) bpe_chunk(chunk, toks);
    };
    for (std::size_t i = 0; i < text.size();) {
      int special = -1;
      for (int id : specials_) {
        const std::string& sp = vocab[static_cast<std::size_t>(id)];
        if (text.compare(i, sp.size(), sp) == 0) {
          special = id;
          break;
        }
      }
      if (special < 0) {
        ++i;
        continue;
      }
      flush(i);
      toks.push_back(special);
      i += vocab[static_cast<std::size_t>(special)].size();
      start = i;
    }
    flush(text.size());
    if (eos) toks.push_back(eos_id);
    return toks;
  }

  std::unordered_map<std::string, int> index_;
  std::unordered_map<std::string, int> merge_rank_;
  std::unordered_map<std::uint32_t, std::uint8_t> unicode_to_byte_;
  std::array<std::string, 256> byte_to_piece_{};
  std::vector<int> specials_;
  std::array<int, 256> byte_ids_{};
  int space_id_ = -1;
};

/// Reads a llama2.c tokenizer.bin: int32 max_token_length, then per token float score, int32
/// length, bytes. `vocab_size` comes from the model (the file does not store it); a file with
/// fewer tokens is refused, extra bytes after the last token are refused too.
inline Status load_llama2c_tokenizer(std::shared_ptr<const MappedFile> f, int vocab_size, Tokenizer& out) {
  const std::string& path = f->path();
  if (vocab_size < 1 || vocab_size > (1 << 24)) {
    return {StatusCode::kInvalidArgument,
            path + ": vocabulary size " + std::to_string(vocab_size) + " is out of range; allowed: 1..16777216"};
  }
  ByteReader r(f->bytes(), path);
  std::int32_t max_len = 0;
  THINKV_RETURN_IF_ERROR(r.read(max_len, "int32 max_token_length"));
  if (max_len < 1 || max_len > (1 << 16)) {
    return r.corrupt_at(
        0, "max_token_length " + std::to_string(max_len) + " is out of range 1..65536; not a llama2.c tokenizer file");
  }
  Tokenizer t;
  t.source = path;
  // Each token takes at least 8 bytes (score, length): reserve no more than the file can hold.
  const std::size_t fit = std::min(static_cast<std::size_t>(vocab_size), f->size() / 8 + 1);
  t.vocab.reserve(fit);
  t.scores.reserve(fit);
  for (int i = 0; i < vocab_size; ++i) {
    float score = 0.0f;
    std::int32_t len = 0;
    const std::string tok = "token " + std::to_string(i) + " of " + std::to_string(vocab_size);
    THINKV_RETURN_IF_ERROR(r.read(score, "float score of " + tok));
    const std::size_t len_at = r.offset();
    THINKV_RETURN_IF_ERROR(r.read(len, "int32 length of " + tok));
    if (len < 0 || len > max_len) {
      return r.corrupt_at(len_at, "length " + std::to_string(len) + " of " + tok + " is outside 0..max_token_length " +
                                      std::to_string(max_len));
    }
    const std::uint8_t* p = nullptr;
    THINKV_RETURN_IF_ERROR(r.take(static_cast<std::size_t>(len), p, "the bytes of " + tok));
    t.vocab.emplace_back(reinterpret_cast<const char*>(p), static_cast<std::size_t>(len));
    t.scores.push_back(score);
  }
  if (r.remaining() != 0) {
    return r.corrupt("the file has " + std::to_string(r.remaining()) + " bytes after token " +
                     std::to_string(vocab_size - 1) + "; it holds more tokens than the model's vocabulary (" +
                     std::to_string(vocab_size) + "): wrong tokenizer for this model?");
  }
  THINKV_RETURN_IF_ERROR(t.finalize());
  out = std::move(t);
  return Status::ok();
}

/// The same, from a file.
inline Status load_llama2c_tokenizer(const std::string& path, int vocab_size, Tokenizer& out) {
  std::shared_ptr<const MappedFile> f;
  THINKV_RETURN_IF_ERROR(MappedFile::open(path, f));
  return load_llama2c_tokenizer(std::move(f), vocab_size, out);
}

}  // namespace thinkv::decoder
