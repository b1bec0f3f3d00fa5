#pragma once
/// \file gguf.hpp
/// GGUF reader (the llama.cpp file format, versions 2 and 3, little-endian): header, metadata
/// key/values of every value type (uint8..float64, bool, string, nested arrays; keys the loader
/// does not use are read and ignored), tensor infos, alignment (general.alignment, default 32)
/// and the data section; then a Llama model from it: architecture 'llama' only, weights in F32,
/// F16, BF16 or Q8_0 (block = FP16 scale + 32 int8), and the embedded sentencepiece tokenizer
/// (tokenizer.ggml.tokens / scores / token_type, bos/eos ids).
///
/// Every count and length read from the file is checked against the bytes that remain (and
/// element counts against fixed limits, gguf_detail::kMaxArrayElements...) before anything is
/// allocated, and arrays grow only with the elements actually read, so a corrupt header cannot
/// make the reader allocate wildly or read past the end. Refusals name what was found: another
/// architecture, an unsupported tensor type ("Q4_K"), an unknown metadata value type, a bad magic
/// or version.
///
/// Q/K layout: llama.cpp stores 'llama' attn_q/attn_k rows in the interleaved (adjacent-pair)
/// rotary layout that llama2.c also uses (convert_hf_to_gguf.py permutes Hugging Face's
/// rotate-half rows back; convert-llama2c-to-ggml copies llama2.c's rows unchanged), so no
/// permutation is applied here. Checked on stories260K: the .gguf's attn_q/attn_k are
/// bit-identical to the .bin's wq/wk, and both files decode to the same tokens (test_decoder).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "model.hpp"
#include "model_file.hpp"
#include "thinkv/status.hpp"
#include "tokenizer.hpp"

namespace thinkv::decoder {

inline constexpr std::uint32_t kGgufMagic = 0x46554747;  // "GGUF" read little-endian

enum class GgufType : std::uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};

inline const char* gguf_type_name(std::uint32_t t) noexcept {
  static constexpr const char* kNames[] = {"uint8", "int8",   "uint16", "int16",  "uint32", "int32",  "float32",
                                           "bool",  "string", "array",  "uint64", "int64",  "float64"};
  return t < 13 ? kNames[t] : "unknown";
}

/// ggml tensor type names (for messages about types this decoder does not support).
inline std::string ggml_type_name(std::uint32_t t) {
  switch (t) {
    case 0: return "F32";
    case 1: return "F16";
    case 2: return "Q4_0";
    case 3: return "Q4_1";
    case 6: return "Q5_0";
    case 7: return "Q5_1";
    case 8: return "Q8_0";
    case 9: return "Q8_1";
    case 10: return "Q2_K";
    case 11: return "Q3_K";
    case 12: return "Q4_K";
    case 13: return "Q5_K";
    case 14: return "Q6_K";
    case 15: return "Q8_K";
    case 16: return "IQ2_XXS";
    case 17: return "IQ2_XS";
    case 18: return "IQ3_XXS";
    case 19: return "IQ1_S";
    case 20: return "IQ4_NL";
    case 21: return "IQ3_S";
    case 22: return "IQ2_S";
    case 23: return "IQ4_XS";
    case 24: return "I8";
    case 25: return "I16";
    case 26: return "I32";
    case 27: return "I64";
    case 28: return "F64";
    case 29: return "IQ1_M";
    case 30: return "BF16";
    case 34: return "TQ1_0";
    case 35: return "TQ2_0";
    default: return "type " + std::to_string(t) + " (unknown)";
  }
}
inline constexpr std::uint32_t kGgmlF32 = 0, kGgmlF16 = 1, kGgmlQ8_0 = 8, kGgmlBF16 = 30;

/// One metadata value. Arrays keep their elements (strings and numbers).
struct GgufValue {
  GgufType type = GgufType::kU8;
  std::uint64_t u = 0;                 ///< unsigned integers and bool
  std::int64_t i = 0;                  ///< signed integers
  double f = 0.0;                      ///< floats
  std::string s;                       ///< string
  GgufType elem_type = GgufType::kU8;  ///< array element type
  std::vector<GgufValue> array;

  [[nodiscard]] bool is_integer() const noexcept {
    switch (type) {
      case GgufType::kU8:
      case GgufType::kI8:
      case GgufType::kU16:
      case GgufType::kI16:
      case GgufType::kU32:
      case GgufType::kI32:
      case GgufType::kU64:
      case GgufType::kI64: return true;
      default: return false;
    }
  }
  [[nodiscard]] bool is_signed() const noexcept {
    return type == GgufType::kI8 || type == GgufType::kI16 || type == GgufType::kI32 || type == GgufType::kI64;
  }
  [[nodiscard]] bool is_float() const noexcept { return type == GgufType::kF32 || type == GgufType::kF64; }
  /// Numeric value as double (integers, floats, bool).
  [[nodiscard]] double number() const noexcept {
    if (is_float()) return f;
    if (is_signed()) return static_cast<double>(i);
    return static_cast<double>(u);
  }
};

struct GgufTensorInfo {
  std::string name;
  std::vector<std::uint64_t> dims;  ///< ne[0] is the innermost (row length)
  std::uint32_t type = 0;
  std::uint64_t offset = 0;     ///< relative to the data section
  std::size_t info_offset = 0;  ///< where the info record starts (for messages)
};

struct GgufFile {
  std::uint32_t version = 0;
  std::vector<std::pair<std::string, GgufValue>> metadata;
  std::vector<GgufTensorInfo> tensors;
  std::uint64_t alignment = 32;
  std::uint64_t data_offset = 0;
  std::shared_ptr<const MappedFile> file;

  [[nodiscard]] const GgufValue* find(std::string_view key) const {
    for (const auto& [k, v] : metadata) {
      if (k == key) return &v;
    }
    return nullptr;
  }
  [[nodiscard]] const GgufTensorInfo* tensor(std::string_view name) const {
    for (const auto& t : tensors) {
      if (t.name == name) return &t;
    }
    return nullptr;
  }
};

namespace gguf_detail {

inline constexpr int kMaxArrayDepth = 4;
/// Most elements one metadata array may have. Every element read costs a GgufValue (about 100
/// bytes) in memory, so a count is refused above this limit even when the file has the bytes: a
/// corrupt count in a multi-GB file must not become a multi-GB allocation. The largest arrays of
/// real files are tokenizer vocabularies and merge lists (32K to 262K entries); 4M is 16 times the
/// largest vocabulary in use.
inline constexpr std::uint64_t kMaxArrayElements = std::uint64_t{1} << 22;
/// Most metadata key/values and tensors a header may declare (real files: tens of keys, and up to
/// a few thousand tensors for the largest models). Larger counts are refused as corrupt.
inline constexpr std::uint64_t kMaxMetadataEntries = std::uint64_t{1} << 16;
inline constexpr std::uint64_t kMaxTensors = std::uint64_t{1} << 20;
/// Entries reserved up front at most; beyond that vectors grow with the entries actually read, so
/// memory follows the bytes the file really holds rather than the count it claims.
inline constexpr std::uint64_t kMaxReserve = 4096;

inline Status read_string(ByteReader& r, std::string& out, const std::string& what) {
  std::uint64_t n = 0;
  const std::size_t at = r.offset();
  THINKV_RETURN_IF_ERROR(r.read(n, "uint64 length of " + what));
  if (n > r.remaining()) {
    return r.corrupt_at(at, "length " + std::to_string(n) + " of " + what + " exceeds the " +
                                std::to_string(r.remaining()) + " bytes that remain");
  }
  const std::uint8_t* p = nullptr;
  THINKV_RETURN_IF_ERROR(r.take(static_cast<std::size_t>(n), p, what));
  out.assign(reinterpret_cast<const char*>(p), static_cast<std::size_t>(n));
  return Status::ok();
}

/// Smallest encoded size of a value of type t (for bounding array counts).
inline std::size_t min_size(GgufType t) {
  switch (t) {
    case GgufType::kU8:
    case GgufType::kI8:
    case GgufType::kBool: return 1;
    case GgufType::kU16:
    case GgufType::kI16: return 2;
    case GgufType::kU32:
    case GgufType::kI32:
    case GgufType::kF32: return 4;
    case GgufType::kString: return 8;
    case GgufType::kArray: return 12;
    case GgufType::kU64:
    case GgufType::kI64:
    case GgufType::kF64: return 8;
  }
  return 1;
}

/// Reads one little-endian scalar of type T into `dst` (the value's u, i or f field).
template <class T, class D>
Status read_scalar(ByteReader& r, const std::string& what, D& dst) {
  T x{};
  THINKV_RETURN_IF_ERROR(r.read(x, what));
  dst = static_cast<D>(x);
  return Status::ok();
}

inline Status read_value(ByteReader& r, std::uint32_t type, GgufValue& v, const std::string& key, int depth) {
  if (type > 12) {
    return r.corrupt("metadata key '" + key + "' has unknown value type " + std::to_string(type) +
                     " (known: 0..12); the file is corrupt or from a newer GGUF version");
  }
  v.type = static_cast<GgufType>(type);
  const std::string what = "value of '" + key + "' (" + gguf_type_name(type) + ")";
  switch (v.type) {
    case GgufType::kU8: THINKV_RETURN_IF_ERROR(read_scalar<std::uint8_t>(r, what, v.u)); break;
    case GgufType::kI8: THINKV_RETURN_IF_ERROR(read_scalar<std::int8_t>(r, what, v.i)); break;
    case GgufType::kU16: THINKV_RETURN_IF_ERROR(read_scalar<std::uint16_t>(r, what, v.u)); break;
    case GgufType::kI16: THINKV_RETURN_IF_ERROR(read_scalar<std::int16_t>(r, what, v.i)); break;
    case GgufType::kU32: THINKV_RETURN_IF_ERROR(read_scalar<std::uint32_t>(r, what, v.u)); break;
    case GgufType::kI32: THINKV_RETURN_IF_ERROR(read_scalar<std::int32_t>(r, what, v.i)); break;
    case GgufType::kU64: THINKV_RETURN_IF_ERROR(read_scalar<std::uint64_t>(r, what, v.u)); break;
    case GgufType::kI64: THINKV_RETURN_IF_ERROR(read_scalar<std::int64_t>(r, what, v.i)); break;
    case GgufType::kF32: THINKV_RETURN_IF_ERROR(read_scalar<float>(r, what, v.f)); break;
    case GgufType::kF64: THINKV_RETURN_IF_ERROR(read_scalar<double>(r, what, v.f)); break;
    case GgufType::kBool: {
      std::uint8_t x = 0;
      const std::size_t at = r.offset();
      THINKV_RETURN_IF_ERROR(r.read(x, what));
      if (x > 1) return r.corrupt_at(at, "bool value of '" + key + "' is " + std::to_string(x) + ", expected 0 or 1");
      v.u = x;
      break;
    }
    case GgufType::kString: THINKV_RETURN_IF_ERROR(read_string(r, v.s, what)); break;
    case GgufType::kArray: {
      if (depth >= kMaxArrayDepth)
        return r.corrupt("arrays nested deeper than " + std::to_string(kMaxArrayDepth) + " in '" + key + "'");
      std::uint32_t et = 0;
      std::uint64_t n = 0;
      THINKV_RETURN_IF_ERROR(r.read(et, "element type of array '" + key + "'"));
      const std::size_t at = r.offset();
      THINKV_RETURN_IF_ERROR(r.read(n, "element count of array '" + key + "'"));
      if (et > 12) {
        return r.corrupt_at(at - 4,
                            "array '" + key + "' has unknown element type " + std::to_string(et) + " (known: 0..12)");
      }
      v.elem_type = static_cast<GgufType>(et);
      if (n > r.remaining() / min_size(v.elem_type)) {
        return r.corrupt_at(at, "array '" + key + "' claims " + std::to_string(n) + " elements of " +
                                    gguf_type_name(et) + ", more than the " + std::to_string(r.remaining()) +
                                    " remaining bytes can hold; the file is corrupt or truncated "
                                    "(re-download or re-convert it)");
      }
      if (n > kMaxArrayElements) {
        return r.corrupt_at(at, "array '" + key + "' claims " + std::to_string(n) + " elements of " +
                                    gguf_type_name(et) + ", more than the " + std::to_string(kMaxArrayElements) +
                                    " this reader accepts (real tokenizer arrays have under 300K);"
                                    " the file is corrupt (re-download or re-convert it)");
      }
      // Grown as elements are read (each takes >= min_size bytes of the file), never sized from
      // the claimed count alone.
      v.array.reserve(static_cast<std::size_t>(std::min(n, kMaxReserve)));
      for (std::uint64_t k = 0; k < n; ++k) {
        GgufValue& e = v.array.emplace_back();
        THINKV_RETURN_IF_ERROR(read_value(r, et, e, key + "[" + std::to_string(k) + "]", depth + 1));
      }
      break;
    }
  }
  return Status::ok();
}

/// Bytes of a tensor of a supported type (0 with `why` set for other types).
inline bool tensor_bytes(const GgufTensorInfo& t, std::uint64_t& bytes, std::string& why) {
  std::uint64_t n = 1;
  for (std::uint64_t d : t.dims) {
    if (mul_overflows(n, d, n)) {
      why = "element count overflows";
      return false;
    }
  }
  switch (t.type) {
    case kGgmlF32:
    case kGgmlF16:
    case kGgmlBF16:
      if (mul_overflows(n, t.type == kGgmlF32 ? 4 : 2, bytes)) {
        why = "size overflows";
        return false;
      }
      return true;
    case kGgmlQ8_0:
      if (t.dims.empty() || t.dims[0] % 32 != 0) {
        why = "Q8_0 row length " + std::to_string(t.dims.empty() ? 0 : t.dims[0]) + " is not a multiple of 32";
        return false;
      }
      bytes = n / 32 * kGgufQ8BlockBytes;
      return true;
    default:
      why = "tensor type " + ggml_type_name(t.type) + " is not supported (supported: F32, F16, BF16, Q8_0)";
      return false;
  }
}

}  // namespace gguf_detail

/// Reads a GGUF file's header, metadata and tensor infos (no tensor data is touched).
inline Status read_gguf(std::shared_ptr<const MappedFile> file, GgufFile& out) {
  using namespace gguf_detail;
  const std::string& path = file->path();
  ByteReader r(file->bytes(), path);
  std::uint32_t magic = 0, version = 0;
  THINKV_RETURN_IF_ERROR(r.read(magic, "the GGUF magic"));
  if (magic != kGgufMagic) {
    char shown[5] = {0, 0, 0, 0, 0};
    std::memcpy(shown, &magic, 4);
    for (char& ch : shown) {
      if (ch != 0 && (ch < 0x20 || ch > 0x7E)) ch = '?';
    }
    return {StatusCode::kInvalidArgument,
            path + ": not a GGUF file: the magic at offset 0 is '" + std::string(shown) + "', expected 'GGUF'"};
  }
  THINKV_RETURN_IF_ERROR(r.read(version, "uint32 GGUF version"));
  if (version != 2 && version != 3) {
    const bool swapped = (version & 0xFFFFu) == 0 && version != 0;
    return {StatusCode::kUnsupported,
            path + ": GGUF version " + std::to_string(version) + " is not supported (supported: 3, and 2)" +
                (swapped ? "; this looks like a big-endian GGUF, which this reader does not handle" : "")};
  }
  std::uint64_t n_tensors = 0, n_kv = 0;
  THINKV_RETURN_IF_ERROR(r.read(n_tensors, "uint64 tensor count"));
  THINKV_RETURN_IF_ERROR(r.read(n_kv, "uint64 metadata key/value count"));
  // A key/value needs at least 8 (key length) + 4 (type) + 1 bytes; a tensor info at least 8 + 4 +
  // 4 + 8.
  if (n_kv > r.remaining() / 13 || n_kv > kMaxMetadataEntries) {
    return r.corrupt_at(16, "metadata count " + std::to_string(n_kv) + " is more than the file can hold (at most " +
                                std::to_string(std::min<std::uint64_t>(r.remaining() / 13, kMaxMetadataEntries)) +
                                "); the file is corrupt");
  }
  if (n_tensors > r.remaining() / 24 || n_tensors > kMaxTensors) {
    return r.corrupt_at(8, "tensor count " + std::to_string(n_tensors) + " is more than the file can hold (at most " +
                               std::to_string(std::min<std::uint64_t>(r.remaining() / 24, kMaxTensors)) +
                               "); the file is corrupt");
  }
  GgufFile g;
  g.version = version;
  g.metadata.reserve(static_cast<std::size_t>(std::min(n_kv, kMaxReserve)));
  for (std::uint64_t k = 0; k < n_kv; ++k) {
    std::string key;
    THINKV_RETURN_IF_ERROR(read_string(r, key, "key of metadata entry " + std::to_string(k)));
    std::uint32_t type = 0;
    THINKV_RETURN_IF_ERROR(r.read(type, "value type of '" + key + "'"));
    GgufValue v;
    THINKV_RETURN_IF_ERROR(read_value(r, type, v, key, 0));
    g.metadata.emplace_back(std::move(key), std::move(v));
  }
  if (const GgufValue* a = g.find("general.alignment")) {
    const std::uint64_t al = a->is_integer() && !a->is_signed() ? a->u : 0;
    if (al == 0 || (al & (al - 1)) != 0 || al > (1u << 20)) {
      return {StatusCode::kInvalidArgument, path +
                                                ": general.alignment must be a power of two (an unsigned "
                                                "integer up to 1 MiB), found " +
                                                std::to_string(a->number())};
    }
    g.alignment = al;
  }
  g.tensors.reserve(static_cast<std::size_t>(std::min(n_tensors, kMaxReserve)));
  for (std::uint64_t k = 0; k < n_tensors; ++k) {
    GgufTensorInfo t;
    t.info_offset = r.offset();
    THINKV_RETURN_IF_ERROR(read_string(r, t.name, "name of tensor " + std::to_string(k)));
    std::uint32_t nd = 0;
    THINKV_RETURN_IF_ERROR(r.read(nd, "dimension count of tensor '" + t.name + "'"));
    if (nd < 1 || nd > 4)
      return r.corrupt("tensor '" + t.name + "' has " + std::to_string(nd) + " dimensions, expected 1..4");
    t.dims.resize(nd);
    for (std::uint32_t d = 0; d < nd; ++d) {
      THINKV_RETURN_IF_ERROR(r.read(t.dims[d], "dimension " + std::to_string(d) + " of tensor '" + t.name + "'"));
      if (t.dims[d] == 0 || t.dims[d] > (std::uint64_t{1} << 40)) {
        return r.corrupt("dimension " + std::to_string(d) + " of tensor '" + t.name + "' is " +
                         std::to_string(t.dims[d]));
      }
    }
    THINKV_RETURN_IF_ERROR(r.read(t.type, "type of tensor '" + t.name + "'"));
    THINKV_RETURN_IF_ERROR(r.read(t.offset, "data offset of tensor '" + t.name + "'"));
    if (t.offset % g.alignment != 0) {
      return r.corrupt("tensor '" + t.name + "' data offset " + std::to_string(t.offset) +
                       " is not a multiple of the alignment " + std::to_string(g.alignment));
    }
    g.tensors.push_back(std::move(t));
  }
  g.data_offset = (r.offset() + g.alignment - 1) / g.alignment * g.alignment;
  if (g.data_offset > file->size()) {
    return {StatusCode::kInvalidArgument, path + ": truncated: the data section would start at offset " +
                                              std::to_string(g.data_offset) + ", beyond the end of the file (size " +
                                              std::to_string(file->size()) + ")"};
  }
  g.file = std::move(file);
  out = std::move(g);
  return Status::ok();
}

namespace gguf_detail {

struct Loader {
  const GgufFile& g;
  Model& m;
  const std::string& path;

  Status get_uint(const std::string& key, bool required, std::uint64_t& out) const {
    const GgufValue* v = g.find(key);
    if (v == nullptr) {
      if (!required) return Status::ok();
      return {StatusCode::kInvalidArgument, path + ": required metadata key '" + key + "' is missing"};
    }
    if (!v->is_integer() || (v->is_signed() && v->i < 0)) {
      return {StatusCode::kInvalidArgument, path + ": metadata '" + key + "' is " +
                                                gguf_type_name(static_cast<std::uint32_t>(v->type)) +
                                                ", expected a non-negative integer"};
    }
    out = v->is_signed() ? static_cast<std::uint64_t>(v->i) : v->u;
    return Status::ok();
  }
  Status get_int(const std::string& key, bool required, int& out) const {
    std::uint64_t u = static_cast<std::uint64_t>(out);
    THINKV_RETURN_IF_ERROR(get_uint(key, required, u));
    if (u > (1u << 30))
      return {StatusCode::kInvalidArgument,
              path + ": metadata '" + key + "' = " + std::to_string(u) + " is out of range"};
    out = static_cast<int>(u);
    return Status::ok();
  }
  Status get_float(const std::string& key, float& out) const {
    const GgufValue* v = g.find(key);
    if (v == nullptr) return Status::ok();
    if (!v->is_float() && !v->is_integer()) {
      return {StatusCode::kInvalidArgument, path + ": metadata '" + key + "' is " +
                                                gguf_type_name(static_cast<std::uint32_t>(v->type)) +
                                                ", expected a number"};
    }
    out = static_cast<float>(v->number());
    return Status::ok();
  }

  /// The tensor's bytes, checked to lie inside the file.
  Status data_of(const GgufTensorInfo& t, const std::uint8_t*& p, std::uint64_t& bytes) const {
    std::string why;
    if (!tensor_bytes(t, bytes, why)) { return {StatusCode::kUnsupported, path + ": tensor '" + t.name + "': " + why}; }
    const std::uint64_t begin = g.data_offset + t.offset;
    if (begin < g.data_offset || begin > g.file->size() || bytes > g.file->size() - begin) {
      return {StatusCode::kInvalidArgument,
              path + ": truncated or corrupt: tensor '" + t.name + "' (" + ggml_type_name(t.type) + ", " +
                  std::to_string(bytes) + " bytes) at offset " + std::to_string(begin) +
                  " extends past the end of the file (size " + std::to_string(g.file->size()) + ")"};
    }
    p = g.file->data() + begin;
    return Status::ok();
  }

  const GgufTensorInfo* need(const std::string& name, Status& s) const {
    const GgufTensorInfo* t = g.tensor(name);
    if (t == nullptr && s.is_ok()) {
      s = Status(StatusCode::kInvalidArgument, path + ": required tensor '" + name + "' is missing");
    }
    return t;
  }

  Status matrix(const std::string& name, std::int64_t rows, std::int64_t cols, Matrix& out) const {
    Status s;
    const GgufTensorInfo* t = need(name, s);
    if (t == nullptr) return s;
    const std::uint64_t r2 = t->dims.size() >= 2 ? t->dims[1] : 1;
    if (t->dims.size() > 2 || t->dims[0] != static_cast<std::uint64_t>(cols) ||
        r2 != static_cast<std::uint64_t>(rows)) {
      std::string shape;
      for (std::size_t i = 0; i < t->dims.size(); ++i) shape += (i ? " x " : "") + std::to_string(t->dims[i]);
      return {StatusCode::kInvalidArgument, path + ": tensor '" + name + "' has dims [" + shape + "], expected [" +
                                                std::to_string(cols) + " x " + std::to_string(rows) + "] (ne0 x ne1)"};
    }
    const std::uint8_t* p = nullptr;
    std::uint64_t bytes = 0;
    THINKV_RETURN_IF_ERROR(data_of(*t, p, bytes));
    Matrix mt;
    mt.rows = rows;
    mt.cols = cols;
    switch (t->type) {
      case kGgmlF32:
        mt.type = WeightType::kF32;
        if (reinterpret_cast<std::uintptr_t>(p) % alignof(float) != 0) {
          m.owned.emplace_back(static_cast<std::size_t>(rows * cols));
          std::memcpy(m.owned.back().data(), p, static_cast<std::size_t>(bytes));
          mt.f32 = m.owned.back().data();
        } else {
          mt.f32 = reinterpret_cast<const float*>(p);
        }
        break;
      case kGgmlF16:
      case kGgmlBF16:
        if (reinterpret_cast<std::uintptr_t>(p) % 2 != 0) {
          return {StatusCode::kUnsupported, path + ": tensor '" + name + "' data is not 2-byte aligned"};
        }
        mt.type = t->type == kGgmlF16 ? WeightType::kF16 : WeightType::kBF16;
        mt.u16 = reinterpret_cast<const std::uint16_t*>(p);
        break;
      case kGgmlQ8_0:
        mt.type = WeightType::kQ8_0;
        mt.blocks = p;
        break;
      default: return {StatusCode::kInternal, path + ": unhandled tensor type"};
    }
    out = mt;
    return Status::ok();
  }

  /// A 1-D tensor of n floats (F32 in place; F16/BF16 converted into owned storage).
  Status vector(const std::string& name, std::int64_t n, const float*& out) const {
    Status s;
    const GgufTensorInfo* t = need(name, s);
    if (t == nullptr) return s;
    if (t->dims.size() != 1 || t->dims[0] != static_cast<std::uint64_t>(n)) {
      return {StatusCode::kInvalidArgument,
              path + ": tensor '" + name + "' should be a vector of " + std::to_string(n) + " values"};
    }
    const std::uint8_t* p = nullptr;
    std::uint64_t bytes = 0;
    THINKV_RETURN_IF_ERROR(data_of(*t, p, bytes));
    if (t->type == kGgmlF32 && reinterpret_cast<std::uintptr_t>(p) % alignof(float) == 0) {
      out = reinterpret_cast<const float*>(p);
      return Status::ok();
    }
    std::vector<float> v(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) {
      std::uint16_t h = 0;
      switch (t->type) {
        case kGgmlF32: std::memcpy(&v[static_cast<std::size_t>(i)], p + 4 * i, 4); break;
        case kGgmlF16:
          std::memcpy(&h, p + 2 * i, 2);
          v[static_cast<std::size_t>(i)] = f16_to_f32(h);
          break;
        case kGgmlBF16:
          std::memcpy(&h, p + 2 * i, 2);
          v[static_cast<std::size_t>(i)] = bf16_to_f32(h);
          break;
        default:
          return {StatusCode::kUnsupported, path + ": tensor '" + name + "' is " + ggml_type_name(t->type) +
                                                "; vectors must be F32, F16 or BF16"};
      }
    }
    m.owned.push_back(std::move(v));
    out = m.owned.back().data();
    return Status::ok();
  }

  Status tokenizer(int vocab) const {
    const GgufValue* model = g.find("tokenizer.ggml.model");
    const GgufValue* tokens = g.find("tokenizer.ggml.tokens");
    if (tokens == nullptr) return Status::ok();  // no embedded tokenizer: --tokenizer is needed
    const std::string kind = model != nullptr ? model->s : std::string("llama");
    if (kind != "llama" && kind != "gpt2") {
      return {StatusCode::kUnsupported, path + ": tokenizer model '" + kind +
                                            "' is not supported (supported: 'llama' sentencepiece and 'gpt2' "
                                            "byte-level BPE); pass a llama2.c tokenizer with --tokenizer"};
    }
    if (tokens->type != GgufType::kArray || tokens->elem_type != GgufType::kString) {
      return {StatusCode::kInvalidArgument, path + ": tokenizer.ggml.tokens must be an array of strings"};
    }
    auto t = std::make_shared<Tokenizer>();
    t->source = path + " (embedded tokenizer)";
    t->kind = kind == "gpt2" ? TokenizerKind::kByteBpe : TokenizerKind::kSentencePiece;
    if (t->kind == TokenizerKind::kByteBpe) {
      const GgufValue* mg = g.find("tokenizer.ggml.merges");
      if (mg == nullptr || mg->type != GgufType::kArray || mg->elem_type != GgufType::kString) {
        return {StatusCode::kInvalidArgument,
                path + ": a 'gpt2' tokenizer needs tokenizer.ggml.merges (array of strings)"};
      }
      t->merges.reserve(mg->array.size());
      for (const GgufValue& v : mg->array) t->merges.push_back(v.s);
    }
    const std::size_t n = tokens->array.size();
    if (static_cast<int>(n) != vocab) {
      return {StatusCode::kInvalidArgument, path + ": the tokenizer has " + std::to_string(n) +
                                                " tokens, the embedding " + std::to_string(vocab) + " rows"};
    }
    t->vocab.reserve(n);
    for (const GgufValue& v : tokens->array) {
      if (t->kind == TokenizerKind::kByteBpe) {
        t->vocab.push_back(v.s);
        continue;
      }
      // sentencepiece writes a space as U+2581 (bytes E2 96 81); llama2.c's tokenizer.bin uses ' '.
      std::string s;
      s.reserve(v.s.size());
      for (std::size_t i = 0; i < v.s.size(); ++i) {
        if (i + 2 < v.s.size() && static_cast<unsigned char>(v.s[i]) == 0xE2 &&
            static_cast<unsigned char>(v.s[i + 1]) == 0x96 && static_cast<unsigned char>(v.s[i + 2]) == 0x81) {
          s += ' ';
          i += 2;
        } else {
          s += v.s[i];
        }
      }
      t->vocab.push_back(std::move(s));
    }
    t->scores.assign(n, 0.0f);
    if (const GgufValue* sc = g.find("tokenizer.ggml.scores")) {
      if (sc->type != GgufType::kArray || sc->array.size() != n) {
        return {StatusCode::kInvalidArgument,
                path + ": tokenizer.ggml.scores must be an array of " + std::to_string(n) + " numbers"};
      }
      for (std::size_t i = 0; i < n; ++i) t->scores[i] = static_cast<float>(sc->array[i].number());
    }
    if (const GgufValue* ty = g.find("tokenizer.ggml.token_type")) {
      if (ty->type == GgufType::kArray && ty->array.size() == n) {
        t->types.resize(n);
        for (std::size_t i = 0; i < n; ++i) {
          // A token type is a small integer (1 normal, 2 unknown, 3 control, 6 byte, ...): a
          // float that is not one, or a value beyond int32, is a corrupt file (and casting it
          // would be undefined behaviour).
          const double x = ty->array[i].number();
          if (!(x >= 0.0 && x <= 255.0) || x != std::floor(x)) {
            return {StatusCode::kInvalidArgument, path + ": tokenizer.ggml.token_type[" + std::to_string(i) +
                                                      "] = " + std::to_string(x) +
                                                      " is not a token type (an integer 0..255); the file is corrupt"};
          }
          t->types[i] = static_cast<std::int32_t>(x);
        }
      }
    }
    // Special ids: absent means llama2.c's defaults (BOS 1, EOS 2, unknown 0); present must be
    // inside the vocabulary (Tokenizer::finalize checks the defaults too).
    auto special = [&](const char* key, std::uint64_t dflt, int& dst) -> Status {
      std::uint64_t id = dflt;
      const bool given = g.find(key) != nullptr;
      THINKV_RETURN_IF_ERROR(get_uint(key, false, id));
      if (given && id >= n) {
        return {StatusCode::kInvalidArgument, path + ": " + key + " = " + std::to_string(id) +
                                                  " is outside the vocabulary of " + std::to_string(n) +
                                                  " tokens; the file is corrupt"};
      }
      dst = static_cast<int>(std::min<std::uint64_t>(id, std::uint64_t{1} << 30));
      return Status::ok();
    };
    THINKV_RETURN_IF_ERROR(special("tokenizer.ggml.bos_token_id", 1, t->bos_id));
    THINKV_RETURN_IF_ERROR(special("tokenizer.ggml.eos_token_id", 2, t->eos_id));
    THINKV_RETURN_IF_ERROR(special("tokenizer.ggml.unknown_token_id", 0, t->unk_id));
    THINKV_RETURN_IF_ERROR(t->finalize());
    m.tokenizer = std::move(t);
    return Status::ok();
  }
};

}  // namespace gguf_detail

/// Builds a Llama model from a parsed GGUF file. `load_tokenizer = false` skips the embedded
/// tokenizer (for callers that bring their own).
inline Status load_gguf_model(const GgufFile& g, Model& out, bool load_tokenizer = true) {
  const std::string& path = g.file->path();
  const GgufValue* arch = g.find("general.architecture");
  if (arch == nullptr || arch->type != GgufType::kString) {
    return {StatusCode::kInvalidArgument, path + ": metadata 'general.architecture' is missing or not a string"};
  }
  if (arch->s != "llama") {
    return {StatusCode::kUnsupported,
            path + ": architecture '" + arch->s + "' is not supported; this decoder runs 'llama' models only"};
  }
  Model m;
  gguf_detail::Loader ld{g, m, path};
  ModelConfig& c = m.config;
  THINKV_RETURN_IF_ERROR(ld.get_int("llama.embedding_length", true, c.dim));
  THINKV_RETURN_IF_ERROR(ld.get_int("llama.block_count", true, c.n_layers));
  THINKV_RETURN_IF_ERROR(ld.get_int("llama.feed_forward_length", true, c.hidden_dim));
  THINKV_RETURN_IF_ERROR(ld.get_int("llama.attention.head_count", true, c.n_heads));
  c.n_kv_heads = c.n_heads;
  THINKV_RETURN_IF_ERROR(ld.get_int("llama.attention.head_count_kv", false, c.n_kv_heads));
  THINKV_RETURN_IF_ERROR(ld.get_int("llama.context_length", true, c.seq_len));
  c.head_dim = c.n_heads > 0 ? c.dim / c.n_heads : 0;
  THINKV_RETURN_IF_ERROR(ld.get_int("llama.attention.key_length", false, c.head_dim));
  int value_len = c.head_dim;
  THINKV_RETURN_IF_ERROR(ld.get_int("llama.attention.value_length", false, value_len));
  if (value_len != c.head_dim) {
    return {StatusCode::kUnsupported, path + ": key_length " + std::to_string(c.head_dim) + " != value_length " +
                                          std::to_string(value_len) + " is not supported"};
  }
  c.rope_dim = c.head_dim;
  THINKV_RETURN_IF_ERROR(ld.get_int("llama.rope.dimension_count", false, c.rope_dim));
  THINKV_RETURN_IF_ERROR(ld.get_float("llama.rope.freq_base", c.rope_theta));
  THINKV_RETURN_IF_ERROR(ld.get_float("llama.attention.layer_norm_rms_epsilon", c.rms_eps));
  if (g.find("llama.expert_count") != nullptr && g.find("llama.expert_count")->number() > 0) {
    return {StatusCode::kUnsupported,
            path + ": mixture-of-experts llama models (llama.expert_count) are not supported"};
  }
  if (const GgufValue* sc = g.find("llama.rope.scaling.type"); sc != nullptr && sc->s != "none" && sc->s != "") {
    return {StatusCode::kUnsupported, path + ": rope scaling '" + sc->s + "' is not supported"};
  }
  const GgufTensorInfo* emb = g.tensor("token_embd.weight");
  if (emb == nullptr) return {StatusCode::kInvalidArgument, path + ": required tensor 'token_embd.weight' is missing"};
  if (emb->dims.size() != 2 || emb->dims[1] > (1u << 24)) {
    return {StatusCode::kInvalidArgument, path + ": tensor 'token_embd.weight' must be 2-D [dim x vocab]"};
  }
  c.vocab_size = static_cast<int>(emb->dims[1]);
  THINKV_RETURN_IF_ERROR(c.validate(path));
  const std::int64_t D = c.dim, H = c.hidden_dim, V = c.vocab_size, Q = c.q_dim(), K = c.kv_dim();
  THINKV_RETURN_IF_ERROR(ld.matrix("token_embd.weight", V, D, m.tok_embeddings));
  THINKV_RETURN_IF_ERROR(ld.vector("output_norm.weight", D, m.final_norm));
  if (g.tensor("output.weight") != nullptr) {
    THINKV_RETURN_IF_ERROR(ld.matrix("output.weight", V, D, m.output));
    c.tied_output = false;
  } else {
    m.output = m.tok_embeddings;
    c.tied_output = true;
  }
  m.layers.resize(static_cast<std::size_t>(c.n_layers));
  for (int l = 0; l < c.n_layers; ++l) {
    LayerWeights& w = m.layers[static_cast<std::size_t>(l)];
    const std::string b = "blk." + std::to_string(l) + ".";
    if (g.tensor(b + "attn_q.bias") != nullptr || g.tensor(b + "attn_k.bias") != nullptr) {
      return {StatusCode::kUnsupported, path + ": attention biases (" + b + "attn_q.bias) are not supported"};
    }
    THINKV_RETURN_IF_ERROR(ld.vector(b + "attn_norm.weight", D, w.attn_norm));
    THINKV_RETURN_IF_ERROR(ld.matrix(b + "attn_q.weight", Q, D, w.wq));
    THINKV_RETURN_IF_ERROR(ld.matrix(b + "attn_k.weight", K, D, w.wk));
    THINKV_RETURN_IF_ERROR(ld.matrix(b + "attn_v.weight", K, D, w.wv));
    THINKV_RETURN_IF_ERROR(ld.matrix(b + "attn_output.weight", D, Q, w.wo));
    THINKV_RETURN_IF_ERROR(ld.vector(b + "ffn_norm.weight", D, w.ffn_norm));
    THINKV_RETURN_IF_ERROR(ld.matrix(b + "ffn_gate.weight", H, D, w.w1));
    THINKV_RETURN_IF_ERROR(ld.matrix(b + "ffn_down.weight", D, H, w.w2));
    THINKV_RETURN_IF_ERROR(ld.matrix(b + "ffn_up.weight", H, D, w.w3));
  }
  if (g.tensor("rope_freqs.weight") != nullptr) {  // Llama 3.x: per-frequency divisors
    const float* f = nullptr;
    THINKV_RETURN_IF_ERROR(ld.vector("rope_freqs.weight", c.rope_dim / 2, f));
    m.rope_freq_factors.assign(f, f + c.rope_dim / 2);
  }
  m.weight_type = m.layers.empty() ? m.tok_embeddings.type : m.layers[0].wq.type;
  if (load_tokenizer) THINKV_RETURN_IF_ERROR(ld.tokenizer(c.vocab_size));
  m.name = file_stem(path);
  m.path = path;
  m.format = "gguf-v" + std::to_string(g.version);
  m.file = g.file;
  THINKV_RETURN_IF_ERROR(m.check_shapes());
  out = std::move(m);
  return Status::ok();
}

}  // namespace thinkv::decoder
