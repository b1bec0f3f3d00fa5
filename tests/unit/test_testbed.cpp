/// \file test_testbed.cpp
/// The reasoning testbed model (models/testbed.bin, see models/README.md) through the decoder:
///  - FullKV in FP16 reproduces PyTorch's greedy output on the H200 (models/testbed/logs/
///    round2_generations.jsonl) character for character: the export, the decoder and the FP16
///    cache are right;
///  - ThinKV's K-means retention beats keeping each segment's first K tokens (KL against FullKV,
///    teacher-forced on FullKV's tokens) on the same problems and budget: replace K-means by
///    first-K and this fails;
///  - with the committed calibration (models/testbed-calib.json) a run has transitions that fire
///    case-1 step-downs: disable case 1 and this fails.
/// The model files ship with the repository, so these tests always run.

#include <catch2/catch.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "../../examples/decoder/decoder.hpp"
#include "thinkv/thought/calibration_file.hpp"

namespace {

using namespace thinkv;
using namespace thinkv::decoder;
namespace fs = std::filesystem;
using Json = thinkv::CalibrationJson;

fs::path repo_models() { return fs::path(__FILE__).parent_path() / ".." / ".." / "models"; }

struct TestProblem {
  std::string id, prompt, answer;
};

std::vector<TestProblem> read_problems(const fs::path& p, int n) {
  std::ifstream f(p);
  REQUIRE(f.good());
  std::vector<TestProblem> out;
  std::string line;
  while (static_cast<int>(out.size()) < n && std::getline(f, line)) {
    const Json v = Json::parse(line, nullptr, /*allow_exceptions=*/false);
    REQUIRE(v.is_object());
    out.push_back(
        {v.at("id").get<std::string>(), v.at("prompt").get<std::string>(), v.at("answer").get<std::string>()});
  }
  return out;
}

/// PyTorch's greedy completion of each problem id (the device run that trained the model).
std::map<std::string, std::string> torch_completions() {
  std::ifstream f(repo_models() / "testbed" / "logs" / "round2_generations.jsonl");
  REQUIRE(f.good());
  std::map<std::string, std::string> out;
  std::string line;
  while (std::getline(f, line)) {
    const Json v = Json::parse(line, nullptr, /*allow_exceptions=*/false);
    REQUIRE(v.is_object());
    out[v.at("id").get<std::string>()] = v.at("completion").get<std::string>();
  }
  return out;
}

struct Testbed {
  Model model;
  Tokenizer tok;
  Testbed() {
    const fs::path m = repo_models() / "testbed.bin";
    const Status s = load_model(m.string(), model);
    INFO(s.to_string());
    REQUIRE(s.is_ok());
    REQUIRE(load_tokenizer_for(model, (repo_models() / "tok128.bin").string(), tok).is_ok());
  }
};

const Testbed& testbed() {
  static const Testbed t;
  return t;
}

CacheSpec spec_for(const Model& m, Method method, int max_tokens, int budget, int prompt_tokens,
                   const ThoughtClassifier& cl = {}) {
  MethodOptions o;
  o.method = method;
  o.cache.max_tokens = max_tokens;
  o.cache.budget = budget;
  o.cache.classifier = cl;
  o.cache.pinned_prefix = prompt_tokens;
  CacheSpec s;
  const Status st = make_cache_spec(m.config, o, s);
  INFO(st.to_string());
  REQUIRE(st.is_ok());
  return s;
}

}  // namespace

TEST_CASE("testbed: FullKV FP16 decoding reproduces PyTorch's greedy output", "[testbed][model]") {
  const Testbed& tb = testbed();
  const auto torch = torch_completions();
  for (const TestProblem& p : read_problems(repo_models() / "eval_public.jsonl", 3)) {
    INFO("problem " << p.id);
    const std::vector<int> prompt = tb.tok.encode(p.prompt, true, false);
    // llama2.c's input convention, as the model was trained: BOS, ' ', the text.
    REQUIRE(prompt.size() == p.prompt.size() + 2);
    REQUIRE(prompt[1] == tb.tok.lookup(" "));
    RunOptions ro;
    ro.steps = tb.model.config.seq_len - static_cast<int>(prompt.size()) + 1;
    ro.bos_id = tb.tok.bos_id;
    ro.eos_id = tb.tok.eos_id;
    RunStats st;
    REQUIRE(run_sequence(tb.model, spec_for(tb.model, Method::kFull, tb.model.config.seq_len, 0, 0), prompt, ro, st)
                .is_ok());
    const std::string text = tb.tok.decode(st.tokens, prompt.back());
    REQUIRE(torch.count(p.id) == 1);
    CHECK(text == torch.at(p.id));
  }
}

TEST_CASE("testbed: K-means retention beats keeping each segment's first K tokens", "[testbed][model]") {
  // tbe (BF16 pages, no quantization noise) at budget 64 with the prompt pinned: every
  // generated segment is shrunk, so the retention choice is what differs. KL(full || method) is
  // teacher-forced on FullKV's tokens, averaged over the problems' steps.
  const Testbed& tb = testbed();
  const auto problems = read_problems(repo_models() / "eval_public.jsonl", 4);
  double kl_kmeans = 0, kl_first = 0;
  for (const TestProblem& p : problems) {
    const std::vector<int> prompt = tb.tok.encode(p.prompt, true, false);
    const int P = static_cast<int>(prompt.size());
    const int steps = 600;
    RunOptions ro;
    ro.bos_id = tb.tok.bos_id;
    ro.eos_id = tb.tok.eos_id;
    const CacheSpec full = spec_for(tb.model, Method::kFull, P + steps, 0, 0);
    Fidelity fk, ff;
    REQUIRE(measure_fidelity(tb.model, full, spec_for(tb.model, Method::kTbe, P + steps, 64, P), prompt, steps, ro,
                             nullptr, fk)
                .is_ok());
    REQUIRE(measure_fidelity(tb.model, full, spec_for(tb.model, Method::kTbeFirst, P + steps, 64, P), prompt, steps, ro,
                             nullptr, ff)
                .is_ok());
    std::printf("testbed %s: mean KL(full || tbe/64) K-means %.4f, first-K %.4f nats\n", p.id.c_str(), fk.mean_kl,
                ff.mean_kl);
    kl_kmeans += fk.mean_kl;
    kl_first += ff.mean_kl;
    CHECK(fk.mean_kl < ff.mean_kl);  // on every problem
  }
  INFO("mean KL over " << problems.size() << " problems: K-means " << kl_kmeans / problems.size() << ", first-K "
                       << kl_first / problems.size());
  // Measured (4 problems, 600 steps): K-means 0.25-0.57 nats per problem, first-K 0.91-1.08; the
  // bar (K-means below 0.8 x first-K on average) leaves room for the run-to-run noise of nothing:
  // both are deterministic, so the margin only guards against a change that makes them close.
  CHECK(kl_kmeans < 0.8 * kl_first);
}

TEST_CASE("testbed: with the committed calibration, transitions fire case-1 step-downs", "[testbed][model]") {
  const Testbed& tb = testbed();
  CalibrationFile f;
  const fs::path calib = repo_models() / "testbed-calib.json";
  const Status rs = read_calibration_json(calib, f);
  INFO(rs.to_string());
  REQUIRE(rs.is_ok());
  REQUIRE(check_model(f, tb.model.config.n_layers, tb.model.name).is_ok());
  std::vector<ThoughtType> bands(f.band_types.begin(), f.band_types.begin() + f.num_types);
  const ThoughtClassifier cl(f.thresholds, f.layers, f.tau, bands, f.num_layers);
  std::int64_t transitions = 0, case1 = 0, evicted = 0;
  for (const TestProblem& p : read_problems(repo_models() / "eval_public.jsonl", 3)) {
    const std::vector<int> prompt = tb.tok.encode(p.prompt, true, false);
    const int P = static_cast<int>(prompt.size());
    RunOptions ro;
    ro.steps = tb.model.config.seq_len - P + 1;
    ro.bos_id = tb.tok.bos_id;
    ro.eos_id = tb.tok.eos_id;
    RunStats st;
    REQUIRE(
        run_sequence(tb.model, spec_for(tb.model, Method::kThinKv, tb.model.config.seq_len, 512, P, cl), prompt, ro, st)
            .is_ok());
    transitions += st.cache_stats.transition_events;
    case1 += st.cache_stats.case1_steps;
    evicted += st.cache_stats.tokens_evicted;
    // The pinned prompt was never evicted.
    for (const SegmentState& s : st.segments) {
      if (s.start < P) CHECK(s.level == 0);
    }
  }
  CHECK(transitions > 0);
  CHECK(case1 > 0);
  CHECK(evicted > 0);
}
