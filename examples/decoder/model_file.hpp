#pragma once
/// \file model_file.hpp
/// Safe reading of model files: a read-only memory map of the whole file (weights are used in
/// place, so a multi-GB model costs no copy) and a bounds-checked cursor over it. No read ever
/// goes past the end: a truncated or corrupt file yields a Status whose message names the file,
/// the offset, and what was expected there.

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "thinkv/status.hpp"

namespace thinkv::decoder {

/// A whole file mapped read-only (private). Move-only; unmapped on destruction.
class MappedFile {
 public:
  MappedFile() = default;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile() {
    if (data_ != nullptr && size_ > 0 && owned_.empty()) ::munmap(const_cast<std::uint8_t*>(data_), size_);
  }

  /// An in-memory "file" holding a copy of `bytes`, named `name` in messages (fuzzers, tests).
  static std::shared_ptr<const MappedFile> from_bytes(std::string name, std::span<const std::uint8_t> bytes) {
    auto f = std::shared_ptr<MappedFile>(new MappedFile());
    f->path_ = std::move(name);
    f->owned_.assign(bytes.begin(), bytes.end());
    if (f->owned_.empty()) f->owned_.push_back(0);  // a valid pointer; size_ stays 0
    f->data_ = f->owned_.data();
    f->size_ = bytes.size();
    return f;
  }

  /// Maps `path`. Errors name the path and the reason (missing, a directory, unreadable, empty).
  static Status open(const std::string& path, std::shared_ptr<const MappedFile>& out) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      const int e = errno;
      return {StatusCode::kInvalidArgument, path + ": cannot open (" + std::strerror(e) + ")"};
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int e = errno;
      ::close(fd);
      return {StatusCode::kInvalidArgument, path + ": cannot stat (" + std::strerror(e) + ")"};
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      return {StatusCode::kInvalidArgument, path + ": not a regular file"};
    }
    auto f = std::shared_ptr<MappedFile>(new MappedFile());
    f->path_ = path;
    f->size_ = static_cast<std::size_t>(st.st_size);
    if (f->size_ > 0) {
      void* p = ::mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        const int e = errno;
        ::close(fd);
        return {StatusCode::kInvalidArgument,
                path + ": cannot map " + std::to_string(f->size_) + " bytes (" + std::strerror(e) + ")"};
      }
      f->data_ = static_cast<const std::uint8_t*>(p);
    }
    ::close(fd);
    out = std::move(f);
    return Status::ok();
  }

  [[nodiscard]] const std::string& path() const noexcept { return path_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] const std::uint8_t* data() const noexcept { return data_; }
  [[nodiscard]] std::span<const std::uint8_t> bytes() const noexcept { return {data_, size_}; }

 private:
  std::string path_;
  std::vector<std::uint8_t> owned_;  ///< the bytes of an in-memory file (empty: a mapping)
  const std::uint8_t* data_ = nullptr;
  std::size_t size_ = 0;
};

/// A bounds-checked little-endian cursor over a byte range. Every read states what it expects,
/// so that the error of a truncated file says what was missing and where.
class ByteReader {
 public:
  ByteReader(std::span<const std::uint8_t> data, std::string name) : data_(data), name_(std::move(name)) {}

  [[nodiscard]] std::size_t offset() const noexcept { return off_; }
  [[nodiscard]] std::size_t size() const noexcept { return data_.size(); }
  [[nodiscard]] std::size_t remaining() const noexcept { return data_.size() - off_; }
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  [[nodiscard]] const std::uint8_t* base() const noexcept { return data_.data(); }

  /// "<file>: truncated or corrupt at offset N: expected <what> (K bytes), but only M bytes
  /// remain".
  [[nodiscard]] Status truncated(std::string_view what, std::size_t need) const {
    return {StatusCode::kInvalidArgument, name_ + ": truncated or corrupt at offset " + std::to_string(off_) +
                                              ": expected " + std::string(what) + " (" + std::to_string(need) +
                                              " bytes), but only " + std::to_string(remaining()) +
                                              " bytes remain (file size " + std::to_string(data_.size()) + ")"};
  }
  /// "<file>: at offset N: <what>" (a corrupt value rather than a missing one).
  [[nodiscard]] Status corrupt(std::string_view what) const { return corrupt_at(off_, what); }
  [[nodiscard]] Status corrupt_at(std::size_t offset, std::string_view what) const {
    return {StatusCode::kInvalidArgument,
            name_ + ": corrupt at offset " + std::to_string(offset) + ": " + std::string(what)};
  }

  /// Reads a trivially copyable value (little-endian host assumed; checked at compile time).
  template <class T>
  [[nodiscard]] Status read(T& out, std::string_view what) {
    static_assert(std::is_trivially_copyable_v<T>);
    static_assert(std::endian::native == std::endian::little, "model readers assume a little-endian host");
    if (remaining() < sizeof(T)) return truncated(what, sizeof(T));
    std::memcpy(&out, data_.data() + off_, sizeof(T));
    off_ += sizeof(T);
    return Status::ok();
  }

  /// Points `out` at the next n bytes (inside the mapping) and advances past them.
  [[nodiscard]] Status take(std::size_t n, const std::uint8_t*& out, std::string_view what) {
    if (remaining() < n) return truncated(what, n);
    out = data_.data() + off_;
    off_ += n;
    return Status::ok();
  }
  [[nodiscard]] Status skip(std::size_t n, std::string_view what) {
    const std::uint8_t* p = nullptr;
    return take(n, p, what);
  }
  /// Moves to an absolute offset (<= size).
  [[nodiscard]] Status seek(std::size_t offset, std::string_view what) {
    if (offset > data_.size()) {
      return {StatusCode::kInvalidArgument, name_ + ": truncated or corrupt: " + std::string(what) + " at offset " +
                                                std::to_string(offset) + " lies beyond the end of the file (size " +
                                                std::to_string(data_.size()) + ")"};
    }
    off_ = offset;
    return Status::ok();
  }

 private:
  std::span<const std::uint8_t> data_;
  std::string name_;
  std::size_t off_ = 0;
};

/// n * m with overflow detection (sizes of tensors read from untrusted headers).
inline bool mul_overflows(std::uint64_t a, std::uint64_t b, std::uint64_t& out) noexcept {
  if (a != 0 && b > UINT64_MAX / a) return true;
  out = a * b;
  return false;
}

}  // namespace thinkv::decoder
