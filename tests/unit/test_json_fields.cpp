// Typed reading of JSON inputs (core/json_fields.h): every type at the ends of its range, nested
// paths, wrong types and missing fields give exactly "FILE: field 'NAME': expected WHAT, got VALUE"
// or "FILE: field 'NAME': missing", an origami::Error and never one of nlohmann's exceptions; and the
// readers built on it (run configs, model configs) say the same.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/args.h"
#include "core/error.h"
#include "core/json_fields.h"
#include "model/config.h"

using nlohmann::json;
using origami::Error;
using origami::JsonField;
using origami::NumberRange;

namespace {

// The message of the origami::Error `f` throws ("no error" if none; any other exception fails the test).
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not an origami::Error: " << e.what();
    return e.what();
  }
  return "no error";
}

const json kDoc = json::parse(R"({
  "n": 5, "neg": -3, "big": 2147483648, "huge": 18446744073709551615, "float": 2.0, "text": "48", "yes": true,
  "nothing": null, "ratio": 0.5,
  "tensors": {"wte": {"shape": [4, -1], "dtype": "F32"}, "h.0.ln_1.bias": {"shape": [7.5]}},
  "model": {"vocab": {"Ġthe": "x"}},
  "list": [1, 2, 3], "pairs": [[1, 2], [3]]
})");

JsonField doc() { return JsonField(kDoc, "f.json"); }

}  // namespace

TEST(JsonFields, IntegersAtTheEndsOfTheirRange) {
  EXPECT_EQ(doc()["n"].integer(5, 5), 5);
  EXPECT_EQ(doc()["neg"].integer(-3, 0), -3);
  EXPECT_EQ(doc()["big"].integer(1, int64_t(1) << 31), int64_t(1) << 31);
  EXPECT_EQ(error_of([] { doc()["n"].integer(6, 10); }), "f.json: field 'n': expected an integer in [6, 10], got 5");
  EXPECT_EQ(error_of([] { doc()["n"].integer(0, 4); }), "f.json: field 'n': expected an integer in [0, 4], got 5");
  // The value as the file gives it, never as it wraps in 32 or 64 bits.
  EXPECT_EQ(error_of([] { doc()["big"].integer(1, 10000); }),
            "f.json: field 'big': expected an integer in [1, 10000], got 2147483648");
  EXPECT_EQ(error_of([] { doc()["huge"].integer(0, JsonField::kNoLimit); }),
            "f.json: field 'huge': expected a non-negative integer, got 18446744073709551615");
  EXPECT_EQ(error_of([] { doc()["neg"].integer(1, JsonField::kNoLimit); }),
            "f.json: field 'neg': expected a positive integer, got -3");
  EXPECT_EQ(error_of([] { doc()["neg"].integer(-2, JsonField::kNoLimit); }),
            "f.json: field 'neg': expected an integer >= -2, got -3");
  // Not integers: a float (even a whole one), a string, a boolean, null.
  EXPECT_EQ(error_of([] { doc()["float"].integer(0, 9); }), "f.json: field 'float': expected an integer in [0, 9], got 2.0");
  EXPECT_EQ(error_of([] { doc()["text"].integer(1, 64); }), "f.json: field 'text': expected an integer in [1, 64], got \"48\"");
  EXPECT_EQ(error_of([] { doc()["yes"].integer(0, 1); }), "f.json: field 'yes': expected an integer in [0, 1], got true");
  EXPECT_EQ(error_of([] { doc()["nothing"].integer(0, 1); }), "f.json: field 'nothing': expected an integer in [0, 1], got null");
  EXPECT_EQ(error_of([] { doc()["absent"].integer(0, 1); }), "f.json: field 'absent': missing");
  // Optional: the default when absent or null, else the same rules.
  EXPECT_EQ(doc()["absent"].integer_or(7, 0, 1), 7);
  EXPECT_EQ(doc()["nothing"].integer_or(7, 0, 1), 7);
  EXPECT_EQ(error_of([] { doc()["text"].integer_or(7, 0, 100); }),
            "f.json: field 'text': expected an integer in [0, 100], got \"48\"");
}

TEST(JsonFields, NumbersBooleansAndStrings) {
  EXPECT_EQ(doc()["ratio"].number(NumberRange::between(0.5, 1)), 0.5);
  EXPECT_EQ(doc()["n"].number(), 5.0);  // an integer is a number
  EXPECT_EQ(doc()["ratio"].number({0, 0.5, true}), 0.5);
  EXPECT_EQ(error_of([] { doc()["ratio"].number({0.5, 1, true}); }),
            "f.json: field 'ratio': expected a number in (0.5, 1], got 0.5");
  EXPECT_EQ(error_of([] { doc()["neg"].number(NumberRange::positive()); }),
            "f.json: field 'neg': expected a positive number, got -3");
  EXPECT_EQ(error_of([] { doc()["neg"].number(NumberRange::at_least(0)); }),
            "f.json: field 'neg': expected a non-negative number, got -3");
  EXPECT_EQ(error_of([] { doc()["neg"].number(NumberRange::at_least(-1)); }),
            "f.json: field 'neg': expected a number >= -1, got -3");
  EXPECT_EQ(error_of([] { doc()["text"].number(); }), "f.json: field 'text': expected a number, got \"48\"");
  EXPECT_EQ(doc()["absent"].number_or(1.5), 1.5);
  // Never a non-finite number (a document built in code can hold one; a parsed one cannot).
  const json nan = {{"x", std::nan("")}};
  EXPECT_NE(error_of([&] { JsonField(nan, "n.json")["x"].number(); }).find("n.json: field 'x': expected a number, got "),
            std::string::npos);

  EXPECT_TRUE(doc()["yes"].boolean());
  EXPECT_FALSE(doc()["absent"].boolean_or(false));
  EXPECT_EQ(error_of([] { doc()["n"].boolean(); }), "f.json: field 'n': expected true or false, got 5");

  EXPECT_EQ(doc()["text"].string(), "48");
  EXPECT_EQ(doc()["nothing"].string_or("none"), "none");
  EXPECT_EQ(error_of([] { doc()["n"].string(); }), "f.json: field 'n': expected a string, got 5");
  EXPECT_EQ(doc()["tensors"]["wte"]["dtype"].one_of({"F16", "F32"}), 1u);
  EXPECT_EQ(error_of([] { doc()["text"].one_of({"a", "b"}); }), "f.json: field 'text': expected one of \"a\", \"b\", got \"48\"");
  EXPECT_EQ(error_of([] { doc()["n"].one_of({"a"}); }), "f.json: field 'n': expected one of \"a\", got 5");
}

TEST(JsonFields, NestedPathsArraysAndObjects) {
  EXPECT_EQ(doc()["tensors"]["wte"]["shape"][0].integer(0, 8), 4);
  EXPECT_EQ(error_of([] { doc()["tensors"]["wte"]["shape"].integers(0, JsonField::kNoLimit); }),
            "f.json: field 'tensors.wte.shape[1]': expected a non-negative integer, got -1");
  // A key other than a plain word is written as a JSON string in brackets.
  EXPECT_EQ(error_of([] { doc()["tensors"]["h.0.ln_1.bias"]["shape"].integers(0, 9); }),
            "f.json: field 'tensors[\"h.0.ln_1.bias\"].shape[0]': expected an integer in [0, 9], got 7.5");
  EXPECT_EQ(error_of([] {
              doc()["model"]["vocab"].for_each_member([](const std::string&, const JsonField& id) { id.integer(0, 9); });
            }),
            "f.json: field 'model.vocab[\"Ġthe\"]': expected an integer in [0, 9], got \"x\"");
  // Missing members and elements are named by their whole path; reading through a value of the
  // wrong kind names that value.
  EXPECT_EQ(error_of([] { doc()["tensors"]["wpe"]["shape"].integers(0, 1); }), "f.json: field 'tensors.wpe.shape': missing");
  EXPECT_EQ(error_of([] { doc()["list"][3].integer(0, 9); }), "f.json: field 'list[3]': missing");
  EXPECT_EQ(error_of([] { doc()["n"]["x"].integer(0, 9); }), "f.json: field 'n': expected an object, got 5");
  EXPECT_EQ(error_of([] { doc()["n"][0].integer(0, 9); }), "f.json: field 'n': expected an array, got 5");
  EXPECT_FALSE(doc()["nothing"]["x"].present());  // a null holds nothing
  EXPECT_FALSE(doc()["absent"][2].present());
  // Array sizes.
  EXPECT_EQ(doc()["list"].array(3, 3), 3u);
  EXPECT_EQ(error_of([] { doc()["list"].array(2, 2); }), "f.json: field 'list': expected an array of 2 elements, got [1,2,3]");
  EXPECT_EQ(error_of([] { doc()["list"].array(4); }), "f.json: field 'list': expected an array of at least 4 elements, got [1,2,3]");
  EXPECT_EQ(error_of([] { doc()["list"].array(1, 2); }), "f.json: field 'list': expected an array of 1 to 2 elements, got [1,2,3]");
  EXPECT_EQ(error_of([] { doc()["n"].array(); }), "f.json: field 'n': expected an array, got 5");
  EXPECT_EQ(error_of([] { doc()["pairs"].for_each_element([](const JsonField& p) { p.array(2, 2); }); }),
            "f.json: field 'pairs[1]': expected an array of 2 elements, got [3]");
  EXPECT_EQ(error_of([] { doc()["list"].object(); }), "f.json: field 'list': expected an object, got [1,2,3]");
  // Members in the file's order, elements in order.
  std::vector<int64_t> seen;
  doc()["list"].for_each_element([&](const JsonField& e) { seen.push_back(e.integer(0, 9)); });
  EXPECT_EQ(seen, (std::vector<int64_t>{1, 2, 3}));
  // The document root has no field part.
  const json list = json::array({1});
  EXPECT_EQ(error_of([&] { JsonField(list, "r.json")["a"].string(); }), "r.json: expected an object, got [1]");
  EXPECT_EQ(doc()["tensors"]["wte"].where(), "f.json: field 'tensors.wte'");
  EXPECT_EQ(doc()["absent"].name(), "absent");
}

TEST(JsonFields, ValuesAreShownShortened) {
  const json j = {{"long", std::string(100, 'x')}, {"utf8", std::string(56, 'x') + "ééé"}};
  EXPECT_EQ(error_of([&] { JsonField(j, "s.json")["long"].integer(0, 1); }),
            "s.json: field 'long': expected an integer in [0, 1], got \"" + std::string(56, 'x') + "...");
  // Never cut inside a UTF-8 character.
  EXPECT_EQ(error_of([&] { JsonField(j, "s.json")["utf8"].integer(0, 1); }),
            "s.json: field 'utf8': expected an integer in [0, 1], got \"" + std::string(56, 'x') + "...");
}

TEST(JsonFields, ParseErrorsNameTheFile) {
  EXPECT_EQ(error_of([] { origami::parse_json("{\"a\": ", "p.json"); }).rfind("p.json: not valid JSON (", 0), 0u);
  // A number past double's range is the library's out_of_range, not a parse_error: caught too.
  EXPECT_EQ(error_of([] { origami::parse_json("{\"a\": 1e400}", "p.json"); }).rfind("p.json: not valid JSON (", 0), 0u);
  EXPECT_EQ(origami::parse_json("{\"a\": 1}", "p.json")["a"], 1);
}

// Whatever a value is, every read returns or throws origami::Error, never a library exception.
TEST(JsonFields, NoLibraryExceptionEscapes) {
  const json values = json::parse(R"([null, true, 0, -1, 3, 2.5, 1e300, 18446744073709551615, -9223372036854775808,
                                      "", "x", [], [1, "a"], {}, {"k": [null]}])");
  const std::vector<std::function<void(const JsonField&)>> reads = {
      [](const JsonField& f) { f.integer(0, 10); },
      [](const JsonField& f) { f.integer(std::numeric_limits<int64_t>::min(), JsonField::kNoLimit); },
      [](const JsonField& f) { f.number(); },
      [](const JsonField& f) { f.number(NumberRange::positive()); },
      [](const JsonField& f) { f.boolean(); },
      [](const JsonField& f) { f.string(); },
      [](const JsonField& f) { f.one_of({"x"}); },
      [](const JsonField& f) { f.integers(0, 5); },
      [](const JsonField& f) { f.object(); },
      [](const JsonField& f) { f.array(1, 1); },
      [](const JsonField& f) { f["k"][0]["z"].string_or(""); },
      [](const JsonField& f) { f[size_t(1)]["k"].integer_or(0, 0, 1); },
      [](const JsonField& f) { f.for_each_member([](const std::string&, const JsonField& m) { m.number_or(0); }); },
      [](const JsonField& f) { f.for_each_element([](const JsonField& e) { e.boolean_or(false); }); },
  };
  for (size_t v = 0; v < values.size(); ++v) {
    const json doc_v = {{"v", values[v]}};
    for (size_t r = 0; r < reads.size(); ++r) {
      try {
        reads[r](JsonField(doc_v, "v.json")["v"]);
      } catch (const Error& e) {
        EXPECT_EQ(std::string(e.what()).rfind("v.json: field 'v", 0), 0u) << e.what();
      } catch (const std::exception& e) {
        ADD_FAILURE() << "read " << r << " of " << values[v].dump() << ": " << e.what();
      }
    }
  }
}

// A run-config or plan file's values: a switch from true or false, an option from a string or a
// number; a value that is not of its option's type names the file and the field.
TEST(JsonFields, RunConfigValuesNameTheField) {
  auto make = [] {
    origami::Args a("train", "test");
    a.option("lr", "X", "learning rate", "3e-4").option("steps", "N", "steps").option("tp", "T", "tp", "1");
    a.flag("verbose", "talk");
    return a;
  };
  origami::Args a = make();
  a.fill_from_json(JsonField(json{{"steps", "x"}, {"lr", 0.5}, {"verbose", true}}, "run.json"));
  EXPECT_EQ(a.number("lr"), 0.5);
  EXPECT_TRUE(a.on("verbose"));
  EXPECT_EQ(error_of([&] { a.integer("steps"); }), "run.json: field 'steps': expected an integer, got \"x\"");
  origami::Args b = make();
  b.fill_from_json(JsonField(json{{"steps", 99999999999999999999.0}}, "run.json"));
  EXPECT_EQ(error_of([&] { b.integer("steps"); }), "run.json: field 'steps': expected an integer, got 1e+20");
  EXPECT_EQ(error_of([&] { make().fill_from_json(JsonField(json{{"verbose", 1}}, "run.json")); }),
            "run.json: field 'verbose': expected true or false, got 1");
  EXPECT_EQ(error_of([&] { make().fill_from_json(JsonField(json{{"steps", {1, 2}}}, "run.json")); }),
            "run.json: field 'steps': expected a string or a number, got [1,2]");
  EXPECT_EQ(error_of([&] { make().fill_from_json(JsonField(json::array(), "run.json")); }),
            "run.json: expected an object, got []");
  // A plan's layout: the path names the member.
  const json plan = {{"layout", {{"tp", 1.5}}}, {"devices", 2}};
  origami::Args c = make();
  c.fill_from_json(JsonField(plan, "plan.json")["layout"]);
  EXPECT_EQ(error_of([&] { c.integer("tp"); }), "plan.json: field 'layout.tp': expected an integer, got 1.5");
}

// A run config after a plan: a key the plan gave keeps the plan's value; the same value however written
// (2 and 2.0, true for a switch) passes, another is an error naming both; a flag wins over both.
TEST(JsonFields, SecondFileAgreesWithTheFirst) {
  auto make = [] {
    origami::Args a("train", "test");
    a.option("lr", "X", "learning rate", "3e-4").option("tp", "T", "tp", "1").option("precision", "P", "p", "fp32");
    a.flag("sequence-parallel", "sp");
    return a;
  };
  const json plan = {{"layout", {{"tp", 2}, {"lr", 0.001}, {"precision", "fp32"}, {"sequence-parallel", true}}}};
  origami::Args a = make();
  a.fill_from_json(JsonField(plan, "plan.json")["layout"]);
  a.fill_from_json(JsonField(json{{"tp", 2.0}, {"lr", 1e-3}, {"precision", "fp32"}, {"sequence-parallel", true}}, "rc.json"));
  EXPECT_EQ(a.integer("tp"), 2);
  EXPECT_TRUE(a.on("sequence-parallel"));
  EXPECT_EQ(error_of([&] {
              origami::Args b = make();
              b.fill_from_json(JsonField(plan, "plan.json")["layout"]);
              b.fill_from_json(JsonField(json{{"tp", 4}}, "rc.json"));
            }),
            "rc.json: field 'tp' gives 4, and plan.json: field 'layout.tp' gives 2: the first wins, so this one would "
            "be ignored; drop one, or give --tp on the command line");
  origami::Args c = make();
  const char* argv[] = {"train", "--tp", "8"};
  c.parse(3, const_cast<char**>(argv));
  c.fill_from_json(JsonField(plan, "plan.json")["layout"]);
  c.fill_from_json(JsonField(json{{"tp", 4}}, "rc.json"));
  EXPECT_EQ(c.integer("tp"), 8);
}

namespace {

std::string config_error(const json& changes = json::object()) {
  json cfg = {{"model_type", "mixtral"}, {"hidden_size", 48},          {"num_attention_heads", 4},
              {"num_key_value_heads", 2}, {"intermediate_size", 40},   {"num_hidden_layers", 2},
              {"vocab_size", 257},        {"max_position_embeddings", 64}, {"num_local_experts", 4},
              {"num_experts_per_tok", 2}};
  cfg.update(changes);
  return error_of([&] { origami::parse_model_config(cfg, "config.json"); });
}

}  // namespace

// The model config: dimensions within their limits (model/config.h), every field by its type.
TEST(JsonFields, ModelConfigLimitsAndTypes) {
  using origami::ModelLimits;
  EXPECT_EQ(config_error(), "no error");
  EXPECT_EQ(config_error({{"num_hidden_layers", ModelLimits::layers}}), "no error");
  EXPECT_EQ(config_error({{"num_hidden_layers", ModelLimits::layers + 1}}),
            "config.json: field 'num_hidden_layers': expected an integer in [1, 10000], got 10001");
  EXPECT_EQ(config_error({{"num_hidden_layers", 2147483648}}),
            "config.json: field 'num_hidden_layers': expected an integer in [1, 10000], got 2147483648");
  EXPECT_EQ(config_error({{"hidden_size", "48"}}),
            "config.json: field 'hidden_size': expected an integer in [1, 1048576], got \"48\"");
  EXPECT_EQ(config_error({{"intermediate_size", 2305843009213693952}}),
            "config.json: field 'intermediate_size': expected an integer in [1, 16777216], got 2305843009213693952");
  EXPECT_EQ(config_error({{"vocab_size", 1000000000000}}),
            "config.json: field 'vocab_size': expected an integer in [1, 16777216], got 1000000000000");
  EXPECT_EQ(config_error({{"max_position_embeddings", 0}}),
            "config.json: field 'max_position_embeddings': expected an integer in [1, 16777216], got 0");
  EXPECT_EQ(config_error({{"num_local_experts", 2147483648}}),
            "config.json: field 'num_local_experts': expected an integer in [1, 65536], got 2147483648");
  EXPECT_EQ(config_error({{"num_experts_per_tok", 5}}),
            "config.json: field 'num_experts_per_tok': expected an integer in [1, 4], got 5");
  EXPECT_EQ(config_error({{"num_key_value_heads", 8}}),
            "config.json: field 'num_key_value_heads': expected an integer in [1, 4], got 8");
  EXPECT_EQ(config_error({{"num_attention_heads", 65537}}),
            "config.json: field 'num_attention_heads': expected an integer in [1, 65536], got 65537");
  EXPECT_EQ(config_error({{"rms_norm_eps", 0}}), "config.json: field 'rms_norm_eps': expected a positive number, got 0");
  EXPECT_EQ(config_error({{"router_aux_loss_coef", -1}}),
            "config.json: field 'router_aux_loss_coef': expected a non-negative number, got -1");
  EXPECT_EQ(config_error({{"tie_word_embeddings", "no"}}),
            "config.json: field 'tie_word_embeddings': expected true or false, got \"no\"");
  EXPECT_EQ(config_error({{"model_type", 5}}),
            "config.json: field 'model_type': expected one of \"gpt2\", \"llama\", \"mixtral\", \"qwen2_moe\", got 5");
  EXPECT_EQ(config_error({{"eos_token_id", "</s>"}}),
            "config.json: field 'eos_token_id': expected an integer in [-2147483648, 2147483647], got \"</s>\"");
  EXPECT_EQ(config_error({{"eos_token_id", {2, 4294967296}}}),
            "config.json: field 'eos_token_id[1]': expected an integer in [-2147483648, 2147483647], got 4294967296");
  EXPECT_EQ(config_error({{"model_type", "qwen2_moe"}, {"num_experts", 4}, {"mlp_only_layers", {0, 2}}}),
            "config.json: field 'mlp_only_layers[1]': expected an integer in [0, 1], got 2");
  // Unsupported fields keep their own message.
  EXPECT_EQ(config_error({{"rope_scaling", {{"type", "linear"}}}}).find("config.json: field 'rope_scaling' = "), 0u);
  const json missing_type = {{"hidden_size", 48}};
  EXPECT_EQ(error_of([&] { origami::parse_model_config(missing_type, "config.json"); }),
            "config.json: field 'model_type': missing");
}

// A capacity: Megatron's ceil((N·K/E)·factor) in doubles, at least 1, at most N (an expert is sent
// each token at most once), so a huge factor pads to N rows rather than overflowing into a capacity of 1.
TEST(ModelConfig, MoeCapacityBounds) {
  origami::MoeRouting r;
  EXPECT_EQ(r.capacity(64, 2, 8), 0);  // dropless
  r.capacity_factor = 1.0;
  EXPECT_EQ(r.capacity(64, 2, 8), 16);
  r.capacity_factor = 1.1;
  EXPECT_EQ(r.capacity(64, 2, 8), 18);
  // as Megatron's doubles round: 50 · 1.1 is 55.00000000000001, so 56 (not the decimal 55); 10 · 1.1 is
  // 11 exactly (the product of the binary 1.1 is a half-ulp tie, to even), so 11
  EXPECT_EQ(r.capacity(200, 2, 8), 56);
  EXPECT_EQ(r.capacity(40, 2, 8), 11);
  r.capacity_factor = 0.1;  // 24720 · 0.1 rounds to 2472.0 exactly (the binary 0.1's exact product is above it)
  EXPECT_EQ(r.capacity(24720, 1, 1), 2472);
  r.capacity_factor = 1.25;  // exact: 10 over 8, never 11
  EXPECT_EQ(r.capacity(32, 2, 8), 10);
  r.capacity_factor = 1.0;
  EXPECT_EQ(r.capacity(40, 2, 8), 10);
  r.capacity_factor = 0.001;
  EXPECT_EQ(r.capacity(64, 2, 8), 1);
  r.capacity_factor = 8.0;
  EXPECT_EQ(r.capacity(64, 2, 8), 64);
  r.capacity_factor = 1e30;
  EXPECT_EQ(r.capacity(64, 2, 8), 64);
}

// Fields a config leaves out take the model type's Hugging Face defaults (MixtralConfig, Qwen2MoeConfig,
// LlamaConfig), so that an exported config means the same model to transformers.
TEST(ModelConfig, DefaultsOfTheModelType) {
  json cfg = {{"hidden_size", 64}, {"num_attention_heads", 16}, {"intermediate_size", 40}, {"num_hidden_layers", 2},
              {"vocab_size", 257}};
  // (model_type, kv heads, max positions, rms_norm_eps, rope_theta)
  const std::tuple<const char*, int64_t, int64_t, double, double> expected[] = {
      {"mixtral", 8, 131072, 1e-5, 1e6}, {"qwen2_moe", 16, 32768, 1e-6, 1e4}, {"llama", 16, 2048, 1e-6, 1e4}};
  for (const auto& [type, kv, positions, eps, theta] : expected) {
    cfg["model_type"] = type;
    const origami::ModelConfig c = origami::parse_model_config(cfg, "config.json");
    EXPECT_EQ(c.num_kv_heads, kv) << type;
    EXPECT_EQ(c.max_positions, positions) << type;
    EXPECT_DOUBLE_EQ(c.norm_eps, eps) << type;
    EXPECT_DOUBLE_EQ(c.rope_theta, theta) << type;
    // and what they took is written into the config a checkpoint keeps
    EXPECT_EQ(c.raw.at("num_key_value_heads").get<int64_t>(), kv) << type;
    EXPECT_DOUBLE_EQ(c.raw.at("rope_theta").get<double>(), theta) << type;
    EXPECT_DOUBLE_EQ(c.raw.at("rms_norm_eps").get<double>(), eps) << type;
    EXPECT_EQ(c.raw.at("max_position_embeddings").get<int64_t>(), positions) << type;
  }
}

// Without num_experts_per_tok, Hugging Face's defaults: Mixtral routes each token to 2 experts,
// Qwen2-MoE to 4.
TEST(ModelConfig, TopKDefaults) {
  json cfg = {{"hidden_size", 48},       {"num_attention_heads", 4}, {"num_key_value_heads", 2},
              {"intermediate_size", 40}, {"num_hidden_layers", 2},   {"vocab_size", 257},
              {"max_position_embeddings", 64}};
  cfg["model_type"] = "mixtral";
  EXPECT_EQ(origami::parse_model_config(cfg, "config.json").top_k, 2);
  cfg["model_type"] = "qwen2_moe";
  EXPECT_EQ(origami::parse_model_config(cfg, "config.json").top_k, 4);
  // A default the other fields rule out is an error naming the field left out, not a router that
  // picks more experts than there are (it read and wrote out of bounds) or a message about a field
  // the user never wrote.
  cfg["num_experts"] = 2;
  EXPECT_EQ(error_of([&] { origami::parse_model_config(cfg, "config.json"); }),
            "config.json: field 'num_experts_per_tok' is not given, and its default, 4, exceeds the number of "
            "experts (2): give it");
  cfg["num_experts_per_tok"] = 2;
  EXPECT_EQ(origami::parse_model_config(cfg, "config.json").top_k, 2);
  json mixtral = {{"model_type", "mixtral"}, {"hidden_size", 48}, {"num_attention_heads", 4},
                  {"intermediate_size", 40}, {"num_hidden_layers", 2}, {"vocab_size", 257}};
  EXPECT_EQ(error_of([&] { origami::parse_model_config(mixtral, "config.json"); }),
            "config.json: field 'num_key_value_heads' is not given, and its default, 8, exceeds "
            "num_attention_heads (4): give it");
}

// initializer_range sets the standard deviation a fresh run draws its weights with (Hugging Face's
// default 0.02); it is a positive number.
TEST(ModelConfig, InitializerRange) {
  EXPECT_DOUBLE_EQ(origami::parse_model_config(json{{"model_type", "gpt2"}}, "config.json").init_std, 0.02);
  EXPECT_DOUBLE_EQ(
      origami::parse_model_config(json{{"model_type", "gpt2"}, {"initializer_range", 0.006}}, "config.json").init_std,
      0.006);
  EXPECT_EQ(config_error({{"initializer_range", 0}}),
            "config.json: field 'initializer_range': expected a number in [1e-12, 1000], got 0");
}
