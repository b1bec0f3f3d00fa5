#pragma once
/// \file cli_args.hpp
/// The command-line parser of the `thinkv` subcommands. CLI11 (Debian: libcli11-dev) splits the
/// command line ("--name value", "--name=value", "-n value", flags, "--" before positionals) and
/// finds each option; ThinKV's own checks turn each value into a setting and word the errors
/// "<flag> <value>: <what it must be>", which `parse` prints as "thinkv <cmd>: <message>" above
/// the usage (exit status 2). `-h/--help` prints the subcommand's hand-written usage, not
/// CLI11's generated help. Given twice, an option takes its last value.

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "../decoder/cli_util.hpp"

namespace thinkv::decoder::cli {

/// Prints "thinkv <cmd>: <msg>", the usage and where to read more; returns the usage exit status.
inline int usage_error(const char* cmd, const char* usage, const std::string& msg) {
  std::fprintf(stderr, "thinkv %s: %s\n%sRun `thinkv %s --help` for details.\n", cmd, msg.c_str(), usage, cmd);
  return kExitUsage;
}

class ArgParser {
 public:
  /// Checks one value: stores it and returns "", or returns why it is refused ("must be ...").
  using Check = std::function<std::string(const std::string& value)>;

  ArgParser(const char* cmd, const char* usage) : cmd_(cmd), usage_(usage), app_("", std::string("thinkv ") + cmd) {
    app_.set_help_flag();  // the hand-written usage instead (help())
    app_.add_flag("-h,--help", help_);
    app_.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  }
  ArgParser(const ArgParser&) = delete;
  ArgParser& operator=(const ArgParser&) = delete;

  [[nodiscard]] CLI::App& app() noexcept { return app_; }
  [[nodiscard]] bool help() const noexcept { return help_; }
  [[nodiscard]] const char* command() const noexcept { return cmd_; }

  /// An option taking one value, checked by `check`. `names`: CLI11 syntax ("-m,--model").
  CLI::Option* value(const std::string& names, Check check) {
    const std::string flag = display_name(names);
    return app_.add_option_function<std::string>(names, [flag, check = std::move(check)](const std::string& v) {
      if (std::string why = check(v); !why.empty()) {
        throw CLI::ValidationError(v.empty() ? flag + ": " + why : flag + " " + v + ": " + why);
      }
    });
  }
  /// A non-empty text value (a file name, a pattern); `what` names it in the error.
  CLI::Option* text(const std::string& names, std::string& out, const std::string& what) {
    return value(names, [&out, what](const std::string& v) {
      if (v.empty()) return "needs " + what;
      out = v;
      return std::string();
    });
  }
  /// An integer in [lo, hi]; `must` says what it must be ("must be an integer >= 1").
  CLI::Option* integer(const std::string& names, int& out, long long lo, long long hi, const std::string& must) {
    return value(
        names, [&out, lo, hi, must](const std::string& v) { return parse_int(v, lo, hi, out) ? std::string() : must; });
  }
  /// A flag; "--a,!--no-a" gives a flag and its negation (the last one given wins).
  CLI::Option* flag(const std::string& names, bool& out) { return app_.add_flag(names, out); }

  /// Parses argv (argv[0] is the subcommand's name). 0 when parsed (check help() next); the usage
  /// exit status after printing the error.
  int parse(int argc, char** argv) {
    try {
      app_.parse(argc, argv);
    } catch (const CLI::ParseError& e) { return error(message(e)); }
    return 0;
  }
  /// Parses an argument list (no program name).
  int parse(std::vector<std::string> args) {
    try {
      std::reverse(args.begin(), args.end());  // CLI11 takes them last first
      app_.parse(args);
    } catch (const CLI::ParseError& e) { return error(message(e)); }
    return 0;
  }
  /// Prints a usage error of this subcommand; returns the usage exit status.
  int error(const std::string& msg) const { return usage_error(cmd_, usage_, msg); }

 private:
  /// CLI11's message, with "--steps: 1 required TEXT missing" said as "--steps needs a value".
  static std::string message(const CLI::ParseError& e) {
    std::string m = e.what();
    const std::string missing = " required TEXT missing";
    if (m.ends_with(missing)) {
      if (const auto colon = m.find(": "); colon != std::string::npos) return m.substr(0, colon) + " needs a value";
    }
    return m;
  }
  /// "-m,--model" -> "--model" (the long name, as the usage text spells it).
  static std::string display_name(const std::string& names) {
    std::string best;
    std::size_t start = 0;
    while (start <= names.size()) {
      const std::size_t comma = names.find(',', start);
      std::string n = names.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
      if (best.empty() || (n.starts_with("--") && !best.starts_with("--"))) best = n;
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
    return best;
  }

  const char* cmd_;
  const char* usage_;
  CLI::App app_;
  bool help_ = false;
};

}  // namespace thinkv::decoder::cli
