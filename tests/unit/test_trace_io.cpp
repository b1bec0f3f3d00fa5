/// \file test_trace_io.cpp
/// Sparsity traces (thinkv/thought/trace.hpp): writer/reader round trip, what the reader accepts,
/// every reader error with its file:line message, writer refusals, merging.

#include <catch2/catch.hpp>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "test_util.hpp"
#include "thinkv/thought/trace.hpp"

using namespace thinkv;
using Catch::Matchers::Contains;
using Catch::Matchers::StartsWith;

namespace {

SparsityTrace random_trace(std::mt19937_64& rng, int layers, int prompts, int max_steps) {
  SparsityTrace t;
  t.model = "model-" + std::to_string(tt::uniform_int(rng, 0, 999));
  t.num_layers = layers;
  for (int p = 0; p < prompts; ++p) {
    PromptTrace pr;
    pr.id = "prompt_" + std::to_string(p) + (p % 3 == 0 ? " with spaces" : "");
    int step = tt::uniform_int(rng, 0, 3);
    const int n = tt::uniform_int(rng, 1, max_steps);
    for (int i = 0; i < n; ++i) {
      pr.steps.push_back(step);
      step += tt::uniform_int(rng, 1, 3);  // gaps are allowed
      for (int l = 0; l < layers; ++l) {
        float v = static_cast<float>(tt::uniform01(rng));
        if (tt::chance(rng, 0.05)) v = tt::chance(rng, 0.5) ? 0.0f : 1.0f;
        if (tt::chance(rng, 0.05)) v = std::nextafter(0.0f, 1.0f);  // denormal
        pr.values.push_back(v);
      }
    }
    t.prompts.push_back(std::move(pr));
  }
  return t;
}

Status read_text(const std::string& text, SparsityTrace& out) {
  std::istringstream in(text);
  return read_sparsity_trace(in, "t.csv", out);
}

std::string read_error(const std::string& text) {
  SparsityTrace out;
  out.model = "unchanged";
  const Status s = read_text(text, out);
  INFO("input:\n" << text);
  REQUIRE_FALSE(s.is_ok());
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(out.model == "unchanged");
  return s.message();
}

const std::string kHead = "# thinkv-sparsity-trace v2\n# model: m\n# num_layers: 3\nprompt,step,l0,l1,l2\n";

bool same_trace(const SparsityTrace& a, const SparsityTrace& b) {
  if (a.model != b.model || a.num_layers != b.num_layers || a.prompts.size() != b.prompts.size()) return false;
  for (std::size_t p = 0; p < a.prompts.size(); ++p) {
    const PromptTrace &x = a.prompts[p], &y = b.prompts[p];
    if (x.id != y.id || x.steps != y.steps || x.values.size() != y.values.size()) return false;
    if (std::memcmp(x.values.data(), y.values.data(), x.values.size() * sizeof(float)) != 0) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("trace: write then read gives the same trace bit for bit", "[trace]") {
  TT_SEEDED_RNG();
  for (int rep = 0; rep < 20; ++rep) {
    const SparsityTrace t = random_trace(rng, tt::uniform_int(rng, 1, 40), tt::uniform_int(rng, 0, 5), 60);
    std::ostringstream os;
    REQUIRE(write_sparsity_trace(os, t).is_ok());
    SparsityTrace back;
    const Status s = read_text(os.str(), back);
    INFO(s);
    REQUIRE(s.is_ok());
    REQUIRE(same_trace(t, back));
    CHECK(back.total_steps() == t.total_steps());
  }
}

TEST_CASE("trace: the reader accepts comments, blanks, CRLF, gaps and interleaved prompts", "[trace]") {
  const std::string text =
      "\xEF\xBB\xBF# thinkv-sparsity-trace v2\r\n"
      "# recorded by: a test\r\n"
      "\r\n"
      "#   model:   my model 7B  \r\n"
      "# num_layers: 2\r\n"
      "# a comment without a colon\r\n"
      " prompt , step , l0 , l1 \r\n"
      "a,0,0.5,1\r\n"
      "b,0,0,0.25\r\n"
      "# a comment between rows\r\n"
      "\r\n"
      " a , 7 , 1e-3 , .5 \r\n"
      "b,3,+0.75,1.0\r\n"
      "# end: 4 rows\r\n"
      "\r\n";
  SparsityTrace t;
  const Status s = read_text(text, t);
  INFO(s);
  REQUIRE(s.is_ok());
  CHECK(t.model == "my model 7B");
  CHECK(t.num_layers == 2);
  REQUIRE(t.prompts.size() == 2);
  CHECK(t.prompts[0].id == "a");
  CHECK(t.prompts[0].steps == std::vector<int>{0, 7});
  CHECK(t.prompts[0].values == std::vector<float>{0.5f, 1.0f, 1e-3f, 0.5f});
  CHECK(t.prompts[1].id == "b");
  CHECK(t.prompts[1].steps == std::vector<int>{0, 3});
  CHECK(t.prompts[1].values == std::vector<float>{0.0f, 0.25f, 0.75f, 1.0f});
  CHECK(t.total_steps() == 4);

  // Headers, a column line and the end line but no rows: a valid, empty trace.
  SparsityTrace e;
  REQUIRE(read_text(kHead + "# end: 0 rows\n", e).is_ok());
  CHECK(e.prompts.empty());
  CHECK(e.num_layers == 3);
}

TEST_CASE("trace: every reader error names file:line and what is wrong", "[trace]") {
  struct Case {
    std::string text;
    std::string expect;
  };
  const std::string h2 = "# thinkv-sparsity-trace v2\n# model: m\n";
  const std::vector<Case> cases = {
      {"", "t.csv: the file is empty"},
      {"\n\n", "t.csv: the file is empty"},
      {"prompt,step,l0\np,0,0.5\n",
       "t.csv:1: not a ThinKV sparsity trace: the first line must be '# thinkv-sparsity-trace v2', found "
       "'prompt,step,l0'"},
      {"# model: m\n", "t.csv:1: not a ThinKV sparsity trace"},
      {"# thinkv-sparsity-trace v3\n", "t.csv:1: unsupported trace version 'v3'"},
      {"# thinkv-sparsity-trace v1\n# model: m\n", "t.csv:1: trace version v1 has no end line"},
      {"# thinkv-sparsity-trace v2\n# thinkv-sparsity-trace v2\n",
       "t.csv:2: the '# thinkv-sparsity-trace' line appears twice"},
      {"# thinkv-sparsity-trace v2\n# num_layers: 3\nprompt,step,l0,l1,l2\n", "t.csv:3: missing '# model:' header"},
      {h2 + "prompt,step,l0\n", "t.csv:3: missing '# num_layers:' header"},
      {h2, "t.csv: missing '# num_layers:' header"},
      {h2 + "# num_layers: 3\n", "t.csv: no column header line 'prompt,step,l0,l1,l2'"},
      {h2 + "# num_layers: abc\n", "t.csv:3: num_layers 'abc' is not an integer in [1, 4096]"},
      {h2 + "# num_layers: 0\n", "t.csv:3: num_layers '0' is not an integer"},
      {h2 + "# num_layers: 99999999999999999999\n", "t.csv:3: num_layers '99999999999999999999' is not an integer"},
      {h2 + "# model: n\n", "t.csv:3: '# model:' is given twice"},
      {"# thinkv-sparsity-trace v2\n# model:\n", "t.csv:2: '# model:' has no name"},
      {h2 + "# num_layers: 3\nprompt,step,l0,l1\n",
       "t.csv:4: the column header names 2 layers but '# num_layers:' says 3"},
      {h2 + "# num_layers: 3\nprompt,step,l0,l2,l1\n", "t.csv:4: column 4 of the header is 'l2', expected 'l1'"},
      {h2 + "# num_layers: 3\nid,step,l0,l1,l2\n",
       "t.csv:4: expected the column header line 'prompt,step,l0,l1,l2', found 'id,step,l0,l1,l2'"},
      {h2 + "# num_layers: 3\np,0,0.1,0.2,0.3\n", "t.csv:4: expected the column header line"},
      {kHead + "# model: late\n", "t.csv:5: '# model:' must come before the column header line"},
      {kHead + "p,0,0.1,0.2\n",
       "t.csv:5: row has 4 columns, expected 5 (prompt, step and 3 layers); the trace is corrupt or truncated — "
       "re-record it"},
      {kHead + "p,0,0.1,0.2,0.3,0.4\n", "t.csv:5: row has 6 columns, expected 5"},
      {kHead + "p,0,0.1,0.2,0.3\np,1,0.1,0.", "t.csv:6: row has 4 columns"},  // truncated file
      {kHead + "p,0,0.1,nan,0.3\n",
       "t.csv:5: layer 1 sparsity 'nan' is not a number in [0,1]; the trace is corrupt — re-record it"},
      {kHead + "p,0,0.1,0.2,inf\n", "t.csv:5: layer 2 sparsity 'inf' is not a number in [0,1]"},
      {kHead + "p,0,-inf,0.2,0.3\n", "t.csv:5: layer 0 sparsity '-inf' is not a number in [0,1]"},
      {kHead + "p,0,1.5,0.2,0.3\n", "t.csv:5: layer 0 sparsity '1.5' is not a number in [0,1]"},
      {kHead + "p,0,0.1,-0.01,0.3\n", "t.csv:5: layer 1 sparsity '-0.01' is not a number in [0,1]"},
      {kHead + "p,0,0.1,abc,0.3\n", "t.csv:5: layer 1 sparsity 'abc' is not a number in [0,1]"},
      {kHead + "p,0,0.1,,0.3\n", "t.csv:5: layer 1 sparsity '' is not a number in [0,1]"},
      {kHead + "p,0,0.1,0.2 0.3,0.3\n", "t.csv:5: layer 1 sparsity '0.2 0.3' is not a number"},
      {kHead + "p,0,0.1,1e999,0.3\n", "t.csv:5: layer 1 sparsity '1e999' is not a number"},
      {kHead + "p,-1,0.1,0.2,0.3\n", "t.csv:5: step '-1' is not an integer >= 0"},
      {kHead + "p,1.5,0.1,0.2,0.3\n", "t.csv:5: step '1.5' is not an integer >= 0"},
      {kHead + "p,x,0.1,0.2,0.3\n", "t.csv:5: step 'x' is not an integer >= 0"},
      {kHead + "p,3000000000,0.1,0.2,0.3\n", "t.csv:5: step '3000000000' is not an integer >= 0"},
      {kHead + ",0,0.1,0.2,0.3\n", "t.csv:5: empty prompt id"},
      {kHead + "p,3,0.1,0.2,0.3\nq,1,0.1,0.2,0.3\np,3,0.1,0.2,0.3\n",
       "t.csv:7: prompt 'p' step 3 does not follow its previous step 3 (line 5); steps must increase within a prompt"},
      {kHead + "p,3,0.1,0.2,0.3\np,2,0.1,0.2,0.3\n",
       "t.csv:6: prompt 'p' step 2 does not follow its previous step 3 (line 5)"},
      // The end line: a file cut at a row boundary, a wrong count, content after it, a bad form.
      {kHead + "p,0,0.1,0.2,0.3\n", "t.csv: no '# end: N rows' line after 1 rows: the file was cut short"},
      {kHead, "t.csv: no '# end: N rows' line after 0 rows"},
      {kHead + "p,0,0.1,0.2,0.3\n# end: 2 rows\n", "t.csv:6: the end line says 2 rows, but the file holds 1"},
      {kHead + "p,0,0.1,0.2,0.3\n# end: 1 rows\np,1,0.1,0.2,0.3\n",
       "t.csv:7: content after the '# end:' line (line 6)"},
      {kHead + "p,0,0.1,0.2,0.3\n# end: one\n", "t.csv:6: the end line must read '# end: N rows'"},
      {"# thinkv-sparsity-trace v2\n# model: m\n# end: 0 rows\n",
       "t.csv:3: the end line must read '# end: N rows' after the rows"},
      // What the writer refuses, the reader refuses too, with the line.
      {"# thinkv-sparsity-trace v2\n# model: a\rb\n# num_layers: 3\n", "t.csv:2: the model name contains a line break"},
      {kHead + "a\rb,0,0.1,0.2,0.3\n", "t.csv:5: prompt id"},
  };
  for (const Case& c : cases) {
    const std::string msg = read_error(c.text);
    INFO("input:\n" << c.text);
    CHECK_THAT(msg, StartsWith(c.expect));
  }
}

TEST_CASE("trace: reading from a path", "[trace]") {
  TT_SEEDED_RNG();
  const auto dir = std::filesystem::temp_directory_path() / ("thinkv_trace_test_" + std::to_string(rng() % 1000000000));
  std::filesystem::create_directories(dir);
  const auto path = dir / "trace.csv";
  const SparsityTrace t = random_trace(rng, 4, 3, 50);
  {
    std::ofstream f(path);
    REQUIRE(write_sparsity_trace(f, t).is_ok());
  }
  SparsityTrace back;
  REQUIRE(read_sparsity_trace(path, back).is_ok());
  CHECK(same_trace(t, back));

  {
    std::ofstream f(path);
    f << kHead << "p,0,0.1,0.2,0.3\np,1,0.1,nan,0.3\n";
  }
  Status s = read_sparsity_trace(path, back);
  REQUIRE_FALSE(s.is_ok());
  CHECK_THAT(s.message(), StartsWith(path.string() + ":6: layer 1 sparsity 'nan' is not a number in [0,1]"));

  s = read_sparsity_trace(dir / "missing.csv", back);
  REQUIRE_FALSE(s.is_ok());
  CHECK_THAT(s.message(), Contains("missing.csv: cannot open the trace file (no such file)"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("trace: the writer refuses invalid traces and writes nothing", "[trace]") {
  TT_SEEDED_RNG();
  const SparsityTrace good = random_trace(rng, 3, 2, 10);
  auto refused = [](const SparsityTrace& t) {
    std::ostringstream os;
    const Status s = write_sparsity_trace(os, t);
    REQUIRE_FALSE(s.is_ok());
    CHECK(os.str().empty());
    return s.message();
  };
  SparsityTrace t = good;
  t.prompts[0].id = "a,b";
  CHECK_THAT(refused(t), Contains("id 'a,b' contains a comma"));
  t = good;
  t.prompts[1].id = "#x";
  CHECK_THAT(refused(t), Contains("starts with '#'"));
  t = good;
  t.prompts[1].id = "";
  CHECK_THAT(refused(t), Contains("is empty"));
  t = good;
  t.prompts[1].id = t.prompts[0].id;
  CHECK_THAT(refused(t), Contains("is used twice"));
  t = good;
  t.prompts[0].values[1] = std::nanf("");
  CHECK_THAT(refused(t), Contains("layer 1 sparsity 'nan' is not a number in [0,1]"));
  t = good;
  t.prompts[0].values.pop_back();
  CHECK_THAT(refused(t), Contains("values; expected steps x 3 layers"));
  t = good;
  t.prompts[0].steps.push_back(t.prompts[0].steps.back());
  t.prompts[0].values.insert(t.prompts[0].values.end(), {0.1f, 0.2f, 0.3f});
  CHECK_THAT(refused(t), Contains("does not increase"));
  t = good;
  t.num_layers = 0;
  CHECK_THAT(refused(t), Contains("num_layers 0 is outside [1, 4096]"));
  t = good;
  t.model = "";
  CHECK_THAT(refused(t), Contains("no model name"));
  t = good;
  t.model = "a\nb";
  CHECK_THAT(refused(t), Contains("line break"));
}

TEST_CASE("trace: merging traces of one model, rejecting others", "[trace]") {
  TT_SEEDED_RNG();
  SparsityTrace a = random_trace(rng, 4, 3, 20);
  SparsityTrace b = random_trace(rng, 4, 2, 20);
  b.model = a.model;
  const std::vector<SparsityTrace> parts = {a, b};
  const std::vector<std::string> names = {"a.csv", "b.csv"};
  SparsityTrace m;
  REQUIRE(merge_traces(parts, names, m).is_ok());
  CHECK(m.model == a.model);
  CHECK(m.num_layers == 4);
  REQUIRE(m.prompts.size() == 5);
  CHECK(m.prompts[3].id == b.prompts[0].id + "~2");  // a duplicate id is renamed
  CHECK(m.prompts[4].id == b.prompts[1].id + "~2");
  CHECK(m.total_steps() == a.total_steps() + b.total_steps());
  CHECK(validate_sparsity_trace(m).is_ok());

  SparsityTrace c = random_trace(rng, 5, 1, 5);
  c.model = a.model;
  const std::vector<SparsityTrace> bad = {a, c};
  SparsityTrace out;
  out.model = "unchanged";
  Status s = merge_traces(bad, names, out);
  REQUIRE_FALSE(s.is_ok());
  CHECK_THAT(s.message(), Contains("a.csv is for model '" + a.model + "' with 4 layers, b.csv for '" + a.model +
                                   "' with 5 layers; calibrate each model from its own traces"));
  CHECK(out.model == "unchanged");
  c = random_trace(rng, 4, 1, 5);
  c.model = "other";
  const std::vector<SparsityTrace> bad2 = {a, c};
  s = merge_traces(bad2, {}, out);
  REQUIRE_FALSE(s.is_ok());
  CHECK_THAT(s.message(), Contains("trace #2 for 'other' with 4 layers"));
  CHECK_FALSE(merge_traces({}, {}, out).is_ok());
}
