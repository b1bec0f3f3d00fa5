#pragma once
/// \file trace.hpp
/// Sparsity traces: the per-layer attention sparsity of every decode step of a set of prompts,
/// recorded from a model and read by the offline calibration (calibration.hpp). The format is a
/// CSV text file, documented in docs/calibration.md:
///
///     # thinkv-sparsity-trace v2
///     # model: stories260K
///     # num_layers: 5
///     prompt,step,l0,l1,l2,l3,l4
///     p0,0,0.41,0.38,0.77,0.52,0.49
///     p0,1,0.44,0.36,0.81,0.50,0.47
///     ...
///     # end: 600 rows
///
/// Lines starting with '#' are headers or comments; the first line must be the magic line; the
/// `model` and `num_layers` headers must come before the column header line; other `# key: value`
/// lines are comments. Blank lines and CRLF line ends are accepted. A row is: prompt id (no comma,
/// not empty, not starting with '#'), step (integer >= 0, strictly increasing within a prompt;
/// gaps are allowed), then num_layers sparsity values in [0,1]. Rows of several prompts may be
/// interleaved. The last line, `# end: N rows` with N the number of data rows, tells a whole file
/// from one cut short (v1 had no such line and is no longer read). The reader applies exactly the
/// writer's checks (validate_sparsity_trace). Every reader error is "<source>:<line>: <what is
/// wrong>; <what to do>".

#include <charconv>
#include <cmath>
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <istream>
#include <ostream>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

#include "thinkv/status.hpp"

namespace thinkv {

inline constexpr std::string_view kSparsityTraceMagic = "thinkv-sparsity-trace";
inline constexpr int kSparsityTraceVersion = 2;
/// Largest layer count a trace may declare (guards against a corrupt header allocating wildly).
inline constexpr int kMaxTraceLayers = 4096;

/// One prompt's decode steps: `values[i * num_layers + l]` is layer l's sparsity at `steps[i]`.
struct PromptTrace {
  std::string id;
  std::vector<int> steps;
  std::vector<float> values;  ///< [steps.size(), num_layers], row-major

  [[nodiscard]] std::size_t num_steps() const noexcept { return steps.size(); }
};

/// A set of prompts recorded from one model.
struct SparsityTrace {
  std::string model;
  int num_layers = 0;
  std::vector<PromptTrace> prompts;

  /// Total decode steps (rows) over all prompts.
  [[nodiscard]] long total_steps() const noexcept {
    long n = 0;
    for (const auto& p : prompts) n += static_cast<long>(p.steps.size());
    return n;
  }
};

namespace trace_detail {

inline std::string_view trim(std::string_view s) noexcept {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

/// At most `max_len` characters of s, with "..." when cut, for quoting in messages.
inline std::string quote(std::string_view s, std::size_t max_len = 40) {
  std::string out;
  for (char c : s.substr(0, max_len)) {
    const auto u = static_cast<unsigned char>(c);
    out += (u < 0x20 || u == 0x7F) ? '?' : c;
  }
  if (s.size() > max_len) out += "...";
  return "'" + out + "'";
}

inline bool parse_int(std::string_view s, long long& out) noexcept {
  if (s.empty()) return false;
  const auto r = std::from_chars(s.data(), s.data() + s.size(), out);
  return r.ec == std::errc() && r.ptr == s.data() + s.size();
}

/// Parses a sparsity value; false unless the whole field is a finite number in [0,1].
inline bool parse_sparsity(std::string_view s, float& out) noexcept {
  if (s.empty()) return false;
  if (s.front() == '+') s.remove_prefix(1);
  float x = 0.0f;
  const auto r = std::from_chars(s.data(), s.data() + s.size(), x);
  if (r.ec != std::errc() || r.ptr != s.data() + s.size()) return false;
  if (!std::isfinite(x) || x < 0.0f || x > 1.0f) return false;
  out = x;
  return true;
}

inline void split_commas(std::string_view line, std::vector<std::string_view>& out) {
  out.clear();
  std::size_t start = 0;
  for (;;) {
    const std::size_t comma = line.find(',', start);
    if (comma == std::string_view::npos) {
      out.push_back(trim(line.substr(start)));
      return;
    }
    out.push_back(trim(line.substr(start, comma - start)));
    start = comma + 1;
  }
}

inline std::string column_header(int num_layers) {
  std::string s = "prompt,step";
  for (int l = 0; l < num_layers; ++l) s += ",l" + std::to_string(l);
  return s;
}

inline std::string short_column_header(int num_layers) {
  if (num_layers <= 3) return column_header(num_layers);
  return "prompt,step,l0,...,l" + std::to_string(num_layers - 1);
}

inline Status error(std::string_view source, long line, const std::string& what) {
  std::string msg(source);
  if (line > 0) msg += ":" + std::to_string(line);
  return {StatusCode::kInvalidArgument, msg + ": " + what};
}

inline std::string valid_id_problem(std::string_view id) {
  if (id.empty()) return "is empty";
  if (id.front() == '#') return "starts with '#'";
  for (char c : id) {
    if (c == ',') return "contains a comma";
    if (c == '\n' || c == '\r') return "contains a line break";
  }
  if (trim(id) != id || id.front() == ' ' || id.front() == '\t') return "has leading or trailing blanks";
  return {};
}

}  // namespace trace_detail

/// Checks a trace's invariants (what the writer requires and the calibration assumes): a model
/// name without line breaks, 1 <= num_layers <= kMaxTraceLayers, well-formed unique prompt ids,
/// values sized [steps, num_layers], finite and in [0,1], steps >= 0 and strictly increasing.
inline Status validate_sparsity_trace(const SparsityTrace& t, std::string_view source = "trace") {
  using trace_detail::error;
  if (t.model.find_first_of("\r\n") != std::string::npos) {
    return error(source, 0, "the model name contains a line break");
  }
  if (t.num_layers < 1 || t.num_layers > kMaxTraceLayers) {
    return error(
        source, 0,
        "num_layers " + std::to_string(t.num_layers) + " is outside [1, " + std::to_string(kMaxTraceLayers) + "]");
  }
  std::unordered_map<std::string_view, std::size_t> seen;
  const auto L = static_cast<std::size_t>(t.num_layers);
  for (std::size_t p = 0; p < t.prompts.size(); ++p) {
    const PromptTrace& pr = t.prompts[p];
    if (const std::string why = trace_detail::valid_id_problem(pr.id); !why.empty()) {
      return error(source, 0,
                   "prompt #" + std::to_string(p) + " id " + trace_detail::quote(pr.id) + " " + why +
                       "; prompt ids must be non-empty, without commas or "
                       "line breaks, and not start with '#'");
    }
    if (!seen.emplace(pr.id, p).second) {
      return error(source, 0, "prompt id " + trace_detail::quote(pr.id) + " is used twice");
    }
    if (pr.values.size() != pr.steps.size() * L) {
      return error(source, 0,
                   "prompt " + trace_detail::quote(pr.id) + " has " + std::to_string(pr.steps.size()) + " steps but " +
                       std::to_string(pr.values.size()) + " values; expected steps x " + std::to_string(t.num_layers) +
                       " layers = " + std::to_string(pr.steps.size() * L));
    }
    for (std::size_t i = 0; i < pr.steps.size(); ++i) {
      if (pr.steps[i] < 0 || (i > 0 && pr.steps[i] <= pr.steps[i - 1])) {
        return error(source, 0,
                     "prompt " + trace_detail::quote(pr.id) + " step " + std::to_string(pr.steps[i]) + " (row " +
                         std::to_string(i) +
                         ") is negative or does not increase; steps must be >= 0 and "
                         "strictly increasing within a prompt");
      }
      for (std::size_t l = 0; l < L; ++l) {
        const float x = pr.values[i * L + l];
        if (!std::isfinite(x) || x < 0.0f || x > 1.0f) {
          char buf[32];
          const auto r = std::to_chars(buf, buf + sizeof buf, x);
          return error(source, 0,
                       "prompt " + trace_detail::quote(pr.id) + " step " + std::to_string(pr.steps[i]) + ": layer " +
                           std::to_string(l) + " sparsity '" + std::string(buf, r.ptr) + "' is not a number in [0,1]");
        }
      }
    }
  }
  return Status::ok();
}

/// Reads a trace from `in`; `source_name` (usually the file name) prefixes every error message.
/// On error `out` is left unchanged.
inline Status read_sparsity_trace(std::istream& in, std::string_view source_name, SparsityTrace& out) {
  using trace_detail::error;
  using trace_detail::quote;
  const std::string_view src = source_name;
  const std::string fix_header = "; a trace starts with '# " + std::string(kSparsityTraceMagic) +
                                 " v2', '# model: <name>' and '# num_layers: <N>' lines";
  SparsityTrace t;
  bool have_magic = false, have_model = false, have_layers = false, have_columns = false;
  std::unordered_map<std::string, std::size_t> index;  // prompt id -> position in t.prompts
  std::vector<long> last_line;                         // per prompt: line of its last row
  std::vector<std::string_view> fields;
  std::string line_buf;
  long line_no = 0, end_line = 0, rows = 0;
  bool first_content = true;
  while (std::getline(in, line_buf)) {
    ++line_no;
    std::string_view line = line_buf;
    if (line_no == 1 && line.size() >= 3 && static_cast<unsigned char>(line[0]) == 0xEF &&
        static_cast<unsigned char>(line[1]) == 0xBB && static_cast<unsigned char>(line[2]) == 0xBF) {
      line.remove_prefix(3);  // UTF-8 byte order mark
    }
    line = trace_detail::trim(line);
    if (line.empty()) continue;
    if (end_line > 0) {
      return error(src, line_no,
                   "content after the '# end:' line (line " + std::to_string(end_line) +
                       "); the end line must be the last; the file is corrupt");
    }

    if (first_content) {
      first_content = false;
      const bool magic_line =
          line.front() == '#' && trace_detail::trim(line.substr(1)).starts_with(kSparsityTraceMagic);
      if (!magic_line) {
        return error(src, line_no,
                     "not a ThinKV sparsity trace: the first line must be '# " + std::string(kSparsityTraceMagic) +
                         " v2', found " + quote(line) + "; record traces with `thinkv trace`");
      }
    }

    if (line.front() == '#') {
      const std::string_view body = trace_detail::trim(line.substr(1));
      if (body.starts_with(kSparsityTraceMagic)) {
        if (have_magic)
          return error(src, line_no, "the '# " + std::string(kSparsityTraceMagic) + "' line appears twice");
        const std::string_view ver = trace_detail::trim(body.substr(kSparsityTraceMagic.size()));
        if (ver == "v1") {
          return error(src, line_no,
                       "trace version v1 has no end line, so a file cut short cannot be told "
                       "from a whole one; re-record it with this thinkv (v2)");
        }
        if (ver != "v2") {
          return error(src, line_no,
                       "unsupported trace version " + quote(ver) +
                           "; this reader knows v2 — use a thinkv that matches the "
                           "recorder, or re-record the trace");
        }
        have_magic = true;
        continue;
      }
      const std::size_t colon = body.find(':');
      if (colon == std::string_view::npos) continue;  // a comment
      const std::string_view key = trace_detail::trim(body.substr(0, colon));
      const std::string_view value = trace_detail::trim(body.substr(colon + 1));
      if (key == "end") {
        long long n = -1;
        const std::string_view num = trace_detail::trim(value.substr(0, value.find(' ')));
        if (!have_columns || !trace_detail::parse_int(num, n) || n < 0 ||
            trace_detail::trim(value.substr(num.size())) != "rows") {
          return error(src, line_no, "the end line must read '# end: N rows' after the rows, found " + quote(line));
        }
        if (n != rows) {
          return error(src, line_no,
                       "the end line says " + std::to_string(n) + " rows, but the file holds " + std::to_string(rows) +
                           "; the file is corrupt — re-record it");
        }
        end_line = line_no;
        continue;
      }
      if (key == "model") {
        if (have_columns) return error(src, line_no, "'# model:' must come before the column header line");
        if (have_model) return error(src, line_no, "'# model:' is given twice");
        if (value.empty()) return error(src, line_no, "'# model:' has no name" + fix_header);
        if (value.find_first_of("\r\n") != std::string_view::npos) {
          return error(src, line_no, "the model name contains a line break; the header is corrupt");
        }
        t.model = std::string(value);
        have_model = true;
      } else if (key == "num_layers") {
        if (have_columns) return error(src, line_no, "'# num_layers:' must come before the column header line");
        if (have_layers) return error(src, line_no, "'# num_layers:' is given twice");
        long long n = 0;
        if (!trace_detail::parse_int(value, n) || n < 1 || n > kMaxTraceLayers) {
          return error(src, line_no,
                       "num_layers " + quote(value) + " is not an integer in [1, " + std::to_string(kMaxTraceLayers) +
                           "]; the header is corrupt");
        }
        t.num_layers = static_cast<int>(n);
        have_layers = true;
      }
      continue;  // other "# key: value" lines are comments
    }

    if (!have_columns) {
      if (!have_model || !have_layers) {
        return error(src, line_no,
                     std::string("missing '# ") + (!have_model ? "model" : "num_layers") +
                         ":' header before the first non-comment line" + fix_header);
      }
      trace_detail::split_commas(line, fields);
      const std::string expected = trace_detail::column_header(t.num_layers);
      const bool names_ok = fields.size() >= 2 && fields[0] == "prompt" && fields[1] == "step";
      if (!names_ok) {
        return error(src, line_no,
                     "expected the column header line '" + trace_detail::short_column_header(t.num_layers) +
                         "', found " + quote(line));
      }
      if (fields.size() != static_cast<std::size_t>(t.num_layers) + 2) {
        return error(src, line_no,
                     "the column header names " + std::to_string(fields.size() - 2) +
                         " layers but '# num_layers:' says " + std::to_string(t.num_layers) +
                         "; the header is corrupt");
      }
      for (int l = 0; l < t.num_layers; ++l) {
        if (fields[static_cast<std::size_t>(l) + 2] != "l" + std::to_string(l)) {
          return error(src, line_no,
                       "column " + std::to_string(l + 3) + " of the header is " +
                           quote(fields[static_cast<std::size_t>(l) + 2]) + ", expected 'l" + std::to_string(l) + "'");
        }
      }
      have_columns = true;
      continue;
    }

    // A data row.
    trace_detail::split_commas(line, fields);
    const std::size_t want = static_cast<std::size_t>(t.num_layers) + 2;
    if (fields.size() != want) {
      return error(src, line_no,
                   "row has " + std::to_string(fields.size()) + " columns, expected " + std::to_string(want) +
                       " (prompt, step and " + std::to_string(t.num_layers) +
                       " layers); the trace is corrupt or truncated — re-record it");
    }
    if (fields[0].empty()) return error(src, line_no, "empty prompt id; every row starts with a prompt id");
    if (const std::string why = trace_detail::valid_id_problem(fields[0]); !why.empty()) {
      return error(src, line_no,
                   "prompt id " + quote(fields[0]) + " " + why +
                       "; prompt ids must be non-empty, without commas or line breaks, and not "
                       "start with '#' — the trace is corrupt");
    }
    long long step = 0;
    if (!trace_detail::parse_int(fields[1], step) || step < 0 || step > 2147483647LL) {
      return error(src, line_no,
                   "step " + quote(fields[1]) + " is not an integer >= 0; the trace is corrupt — re-record it");
    }
    const std::string id(fields[0]);
    auto [it, inserted] = index.emplace(id, t.prompts.size());
    if (inserted) {
      t.prompts.push_back(PromptTrace{id, {}, {}});
      last_line.push_back(0);
    }
    PromptTrace& pr = t.prompts[it->second];
    if (!pr.steps.empty() && step <= pr.steps.back()) {
      return error(src, line_no,
                   "prompt " + quote(id) + " step " + std::to_string(step) + " does not follow its previous step " +
                       std::to_string(pr.steps.back()) + " (line " + std::to_string(last_line[it->second]) +
                       "); steps must increase within a prompt — the trace is corrupt "
                       "or two runs were concatenated: re-record it or give the runs "
                       "different prompt ids");
    }
    const std::size_t base = pr.values.size();
    pr.values.resize(base + static_cast<std::size_t>(t.num_layers));
    for (int l = 0; l < t.num_layers; ++l) {
      const std::string_view f = fields[static_cast<std::size_t>(l) + 2];
      if (!trace_detail::parse_sparsity(f, pr.values[base + static_cast<std::size_t>(l)])) {
        return error(src, line_no,
                     "layer " + std::to_string(l) + " sparsity " + quote(f) +
                         " is not a number in [0,1]; the trace is corrupt — re-record it");
      }
    }
    pr.steps.push_back(static_cast<int>(step));
    last_line[it->second] = line_no;
    ++rows;
  }
  if (in.bad()) return error(src, 0, "read error after line " + std::to_string(line_no));
  if (first_content) return error(src, 0, "the file is empty; expected a ThinKV sparsity trace" + fix_header);
  if (!have_model || !have_layers) {
    return error(src, 0,
                 std::string("missing '# ") + (!have_model ? "model" : "num_layers") + ":' header" + fix_header);
  }
  if (!have_columns) {
    return error(src, 0,
                 "no column header line '" + trace_detail::short_column_header(t.num_layers) +
                     "' (the file ends after its headers)");
  }
  if (end_line == 0) {
    return error(src, 0,
                 "no '# end: N rows' line after " + std::to_string(rows) +
                     " rows: the file was cut short (a trace ends with that line) — re-record it");
  }
  // The reader and the writer agree: whatever was read passes the writer's checks.
  THINKV_RETURN_IF_ERROR(validate_sparsity_trace(t, src));
  out = std::move(t);
  return Status::ok();
}

/// Reads a trace file; errors are prefixed with the path.
inline Status read_sparsity_trace(const std::filesystem::path& path, SparsityTrace& out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    std::error_code ec;
    const bool exists = std::filesystem::exists(path, ec);
    return {StatusCode::kInvalidArgument, path.string() + ": cannot open the trace file (" +
                                              (exists ? "permission denied or not a regular file" : "no such file") +
                                              ")"};
  }
  return read_sparsity_trace(f, path.string(), out);
}

/// Writes `t` in the trace format (values with the shortest digits that read back to the same
/// float). Refuses (without writing) a trace that fails validate_sparsity_trace.
inline Status write_sparsity_trace(std::ostream& os, const SparsityTrace& t) {
  THINKV_RETURN_IF_ERROR(validate_sparsity_trace(t, "write_sparsity_trace"));
  if (t.model.empty()) {
    return {StatusCode::kInvalidArgument,
            "write_sparsity_trace: the trace has no model name; set SparsityTrace::model"};
  }
  std::string buf;
  buf += "# ";
  buf += kSparsityTraceMagic;
  buf += " v2\n# model: " + t.model + "\n# num_layers: " + std::to_string(t.num_layers) + "\n";
  buf += trace_detail::column_header(t.num_layers) + "\n";
  os << buf;
  const auto L = static_cast<std::size_t>(t.num_layers);
  char num[32];
  for (const PromptTrace& p : t.prompts) {
    for (std::size_t i = 0; i < p.steps.size(); ++i) {
      buf.clear();
      buf += p.id;
      buf += ',';
      buf += std::to_string(p.steps[i]);
      for (std::size_t l = 0; l < L; ++l) {
        const auto r = std::to_chars(num, num + sizeof num, p.values[i * L + l]);
        buf += ',';
        buf.append(num, r.ptr);
      }
      buf += '\n';
      os << buf;
    }
  }
  os << "# end: " << t.total_steps() << " rows\n";
  os.flush();
  if (!os) return {StatusCode::kInvalidArgument, "write_sparsity_trace: the output stream failed (disk full?)"};
  return Status::ok();
}

/// Merges traces of one model into `out`, in order. `names` (one per part, may be empty) name
/// the parts in messages. Parts for different models or layer counts are rejected. A prompt id
/// that an earlier part already used is renamed "<id>~2" ("~3", ...), since separately recorded
/// prompts are distinct samples. On error `out` is left unchanged.
inline Status merge_traces(std::span<const SparsityTrace> parts, std::span<const std::string> names,
                           SparsityTrace& out) {
  auto name = [&](std::size_t i) { return i < names.size() ? names[i] : "trace #" + std::to_string(i + 1); };
  if (parts.empty()) { return {StatusCode::kInvalidArgument, "no traces to merge; give at least one trace file"}; }
  SparsityTrace m;
  m.model = parts[0].model;
  m.num_layers = parts[0].num_layers;
  std::unordered_map<std::string, int> used;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const SparsityTrace& p = parts[i];
    if (p.num_layers != m.num_layers || p.model != m.model) {
      return {StatusCode::kInvalidArgument, "traces of different models: " + name(0) + " is for model '" + m.model +
                                                "' with " + std::to_string(m.num_layers) + " layers, " + name(i) +
                                                " for '" + p.model + "' with " + std::to_string(p.num_layers) +
                                                " layers; calibrate each model from its own traces"};
    }
    for (const PromptTrace& pr : p.prompts) {
      PromptTrace c = pr;
      if (used.count(c.id) != 0) {
        for (int k = 2;; ++k) {
          std::string alt = pr.id + "~" + std::to_string(k);
          if (used.count(alt) == 0) {
            c.id = std::move(alt);
            break;
          }
        }
      }
      used.emplace(c.id, 1);
      m.prompts.push_back(std::move(c));
    }
  }
  out = std::move(m);
  return Status::ok();
}

}  // namespace thinkv
