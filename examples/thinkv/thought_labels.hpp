#pragma once
/// \file thought_labels.hpp
/// Ground-truth thought labels of generated text from line rules (`--labels RULES`, used by
/// `thinkv eval` and `thinkv thoughts`). A rules file has one rule per line, 'R <regex>',
/// 'E <regex>' or 'T <regex>' (ECMAScript, searched in each output line; the first rule that
/// matches gives the line's label; '#' lines are comments). A token's label is that of the line
/// its first character is on (a newline belongs to the line it ends).

#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "thinkv/types.hpp"

namespace thinkv::decoder::cli {

struct LabelRule {
  ThoughtType type;
  std::regex re;
  std::string text;
};

inline bool read_label_rules(const std::string& path, std::vector<LabelRule>& out, std::string& err) {
  std::ifstream f(path);
  if (!f) {
    err = path + ": cannot open the labels file";
    return false;
  }
  std::string line;
  int no = 0;
  while (std::getline(f, line)) {
    ++no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line[0] == '#') continue;
    const std::string where = path + ":" + std::to_string(no) + ": ";
    if (line.size() < 3 || line[1] != ' ' || (line[0] != 'R' && line[0] != 'E' && line[0] != 'T')) {
      err = where + "expected 'R <regex>', 'E <regex>' or 'T <regex>'";
      return false;
    }
    LabelRule r;
    r.type = line[0] == 'R'   ? ThoughtType::kReasoning
             : line[0] == 'E' ? ThoughtType::kExecution
                              : ThoughtType::kTransition;
    r.text = line.substr(2);
    try {
      r.re = std::regex(r.text, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      err = where + "bad regular expression '" + r.text + "': " + e.what();
      return false;
    }
    out.push_back(std::move(r));
  }
  if (out.empty()) {
    err = path + ": no rules (lines 'R|E|T <regex>')";
    return false;
  }
  return true;
}

/// Label of each generated token: the thought type of the output line its first character is on
/// (a line's newline belongs to it); -1 where no rule matches.
inline std::vector<int> label_tokens(const std::vector<LabelRule>& rules, const std::vector<std::string>& pieces) {
  std::string text;
  std::vector<std::size_t> start;
  for (const std::string& p : pieces) {
    start.push_back(text.size());
    text += p;
  }
  std::vector<int> char_label(text.size(), -1);
  std::size_t b = 0;
  while (b <= text.size()) {
    std::size_t e = text.find('\n', b);
    const std::size_t end = e == std::string::npos ? text.size() : e;
    const std::string line = text.substr(b, end - b);
    int lab = -1;
    for (const LabelRule& r : rules) {
      if (std::regex_search(line, r.re)) {
        lab = static_cast<int>(r.type);
        break;
      }
    }
    for (std::size_t i = b; i < std::min(text.size(), end + 1); ++i) char_label[i] = lab;
    if (e == std::string::npos) break;
    b = e + 1;
  }
  std::vector<int> out;
  int prev = -1;
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    const int lab = pieces[i].empty() ? prev : char_label[start[i]];
    out.push_back(lab);
    prev = lab;
  }
  return out;
}

}  // namespace thinkv::decoder::cli
