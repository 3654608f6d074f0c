#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/args.h"
#include "core/env.h"
#include "core/error.h"
#include "core/json_fields.h"

using origami::Args;

namespace {
Args make() {
  Args a("train", "test");
  a.option("lr", "X", "learning rate", "3e-4").option("steps", "N", "steps").flag("verbose", "talk");
  return a;
}
bool parse(Args& a, std::vector<std::string> v) {
  v.insert(v.begin(), "train");
  std::vector<char*> argv;
  for (auto& s : v) argv.push_back(s.data());
  return a.parse(int(argv.size()), argv.data());
}
}  // namespace

TEST(Args, DefaultsFlagsAndValues) {
  Args a = make();
  ASSERT_TRUE(parse(a, {"--steps", "12", "--verbose"}));
  EXPECT_DOUBLE_EQ(a.number("lr"), 3e-4);
  EXPECT_EQ(a.integer("steps"), 12);
  EXPECT_TRUE(a.on("verbose"));
  Args b = make();
  ASSERT_TRUE(parse(b, {"--lr=0.5"}));
  EXPECT_DOUBLE_EQ(b.number("lr"), 0.5);
  EXPECT_FALSE(b.has("steps"));
}

TEST(Args, RejectsUnknownMissingAndMalformed) {
  Args a = make();
  EXPECT_THROW(parse(a, {"--nope", "1"}), origami::Error);
  Args b = make();
  EXPECT_THROW(parse(b, {"--steps"}), origami::Error);
  Args c = make();
  ASSERT_TRUE(parse(c, {"--steps", "1x"}));
  EXPECT_THROW(c.integer("steps"), origami::Error);
}

// Numbers are read as written in decimal: strtod's and strtoll's leniencies (leading blanks, hex
// integers and hex floats, infinities) are errors naming the option; a list's items may have blanks
// around them ("2, 2"), nothing else.
TEST(Args, NumbersAreDecimalWithoutBlanks) {
  const auto with = [](const std::string& lr, const std::string& steps) {
    Args a("train", "test");
    a.option("lr", "X", "learning rate").option("steps", "N", "steps").option("pp-layers", "N,N", "layers");
    EXPECT_TRUE(parse(a, {"--lr", lr, "--steps", steps, "--pp-layers", steps}));
    return a;
  };
  for (const char* bad : {" 1", "1 ", "0x10", "0x1p3", "inf", "nan", "1e", "1,5"}) {
    Args a = with(bad, "1");
    EXPECT_THROW(a.number("lr"), origami::Error) << "'" << bad << "'";
  }
  for (const char* bad : {" 5", "5 ", "0x10", "5.0", "1e3", "+-5"}) {
    Args a = with("1", bad);
    EXPECT_THROW(a.integer("steps"), origami::Error) << "'" << bad << "'";
  }
  for (const char* bad : {"0x2,2", "2,,2", "2,2,", "2,2.5", "2 2"}) {
    Args a = with("1", bad);
    EXPECT_THROW(a.integers("pp-layers"), origami::Error) << "'" << bad << "'";
  }
  Args a = with("-2.5e-4", "-7");
  EXPECT_DOUBLE_EQ(a.number("lr"), -2.5e-4);
  EXPECT_EQ(a.integer("steps"), -7);
  Args b = with(".5", "2, 3 ,4");
  EXPECT_DOUBLE_EQ(b.number("lr"), 0.5);
  EXPECT_EQ(b.integers("pp-layers"), (std::vector<int64_t>{2, 3, 4}));
  try {
    with("0x1p3", "1").number("lr");
    ADD_FAILURE() << "0x1p3 was read as a number";
  } catch (const origami::Error& e) {
    EXPECT_STREQ(e.what(), "--lr must be a number, got '0x1p3'");
  }
}

// A misspelt option, key or command is answered with the name most likely meant: a typo (one edit in
// four characters, at most two; a swap of neighbours is one) or the one name it begins; else nothing.
TEST(Args, UnknownNameSuggestsTheClosest) {
  const std::vector<std::string> names = {"steps", "seq-len", "save", "save-every", "tokens-per-step", "lr"};
  EXPECT_EQ(origami::closest_name("step", names), "steps");
  EXPECT_EQ(origami::closest_name("seq-lne", names), "seq-len");     // neighbours swapped
  EXPECT_EQ(origami::closest_name("tokens", names), "tokens-per-step");  // the one name it begins
  EXPECT_EQ(origami::closest_name("sav", names), "save");            // one edit beats a prefix of two
  EXPECT_EQ(origami::closest_name("lrr", names), "lr");              // (a short name: still one edit)
  EXPECT_EQ(origami::closest_name("sepz", names), "");               // two edits in four characters: too far
  EXPECT_EQ(origami::closest_name("learning-rate", names), "");
  Args a = make();
  try {
    parse(a, {"--step", "3"});
    FAIL() << "--step was accepted";
  } catch (const origami::Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown option --step (did you mean --steps?)"), std::string::npos) << e.what();
  }
  Args b = make();
  try {
    b.fill_from_json(origami::JsonField(nlohmann::json{{"verbos", true}}, "run.json"));
    FAIL() << "key verbos was accepted";
  } catch (const origami::Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown key 'verbos' (did you mean 'verbose'?)"), std::string::npos) << e.what();
  }
}

// An option given twice with two values would keep the last silently: an error naming both. The same
// value twice (however spelt) and a switch twice are one setting.
TEST(Args, AnOptionTwiceWithTwoValuesIsAnError) {
  Args a = make();
  try {
    parse(a, {"--lr", "1e-3", "--lr=3e-4"});
    FAIL() << "no error";
  } catch (const origami::Error& e) {
    EXPECT_EQ(std::string(e.what()), "--lr is given twice, as '1e-3' and as '3e-4': the last would win and the first "
                                     "be ignored; give it once");
  }
  Args b = make();
  ASSERT_TRUE(parse(b, {"--lr", "1e-3", "--lr", "0.001", "--verbose", "--verbose"}));
  EXPECT_DOUBLE_EQ(b.number("lr"), 1e-3);
}

TEST(Args, RunConfigFileFillsButFlagsWin) {
  Args a = make();
  ASSERT_TRUE(parse(a, {"--lr", "0.1"}));
  a.fill_from_json(origami::JsonField(nlohmann::json{{"lr", 0.9}, {"steps", 7}}, "run.json"));
  EXPECT_DOUBLE_EQ(a.number("lr"), 0.1);
  EXPECT_EQ(a.integer("steps"), 7);
  EXPECT_THROW(a.fill_from_json(origami::JsonField(nlohmann::json{{"bogus", 1}}, "run.json")), origami::Error);
}

// A second file (a run config after a plan) may repeat the first's value in another spelling — the
// same number, the same list with spaces after its commas — but a different value is an error
// naming both (the first wins, so the second would be ignored).
TEST(Args, LaterFileMayRepeatButNotContradict) {
  auto with_plan = [] {
    Args a("train", "test");
    a.option("lr", "X", "learning rate").option("pp-layers", "N,N", "layers").option("name", "S", "run name");
    EXPECT_TRUE(parse(a, {}));
    a.fill_from_json(origami::JsonField(nlohmann::json{{"lr", 2}, {"pp-layers", "2,2"}, {"name", "a b"}}, "plan.json"));
    return a;
  };
  for (const nlohmann::json& same : {nlohmann::json{{"lr", 2.0}}, nlohmann::json{{"lr", "2"}},
                                     nlohmann::json{{"pp-layers", "2, 2"}}, nlohmann::json{{"pp-layers", "2 ,2 "}},
                                     nlohmann::json{{"name", "a b"}}}) {
    Args a = with_plan();
    EXPECT_NO_THROW(a.fill_from_json(origami::JsonField(same, "run.json"))) << same.dump();
  }
  for (const nlohmann::json& other : {nlohmann::json{{"lr", 3}}, nlohmann::json{{"pp-layers", "2,3"}},
                                      nlohmann::json{{"pp-layers", "2,2,0"}}, nlohmann::json{{"pp-layers", "2,2,"}},
                                      nlohmann::json{{"lr", "0x2"}}, nlohmann::json{{"name", "ab"}}}) {
    Args a = with_plan();
    EXPECT_THROW(a.fill_from_json(origami::JsonField(other, "run.json")), origami::Error) << other.dump();
  }
  Args a = with_plan();
  EXPECT_EQ(a.integers("pp-layers"), (std::vector<int64_t>{2, 2}));
  // Integers compare exactly, beyond a double's 53 bits (a --seed).
  Args seeded("train", "test");
  seeded.option("seed", "N", "seed");
  EXPECT_TRUE(parse(seeded, {}));
  seeded.fill_from_json(origami::JsonField(nlohmann::json{{"seed", "9007199254740993"}}, "plan.json"));
  EXPECT_THROW(seeded.fill_from_json(origami::JsonField(nlohmann::json{{"seed", "9007199254740992"}}, "run.json")),
               origami::Error);
  EXPECT_NO_THROW(seeded.fill_from_json(origami::JsonField(nlohmann::json{{"seed", "9007199254740993"}}, "run.json")));
}

// The environment switches' one parser: unset and empty give the default (the first choice); a
// value outside the choices is one error naming the variable, the value and every choice.
TEST(EnvChoice, DefaultValidAndInvalid) {
  const char* var = "ORIGAMI_TEST_ENV_CHOICE";
  unsetenv(var);
  EXPECT_EQ(origami::env_choice(var, {"auto", "fast", "slow"}), "auto");
  setenv(var, "", 1);
  EXPECT_EQ(origami::env_choice(var, {"auto", "fast", "slow"}), "auto");
  setenv(var, "slow", 1);
  EXPECT_EQ(origami::env_choice(var, {"auto", "fast", "slow"}), "slow");
  setenv(var, "Fast", 1);
  try {
    origami::env_choice(var, {"auto", "fast", "slow"});
    ADD_FAILURE() << "no error for Fast";
  } catch (const origami::Error& e) {
    EXPECT_STREQ(e.what(), "ORIGAMI_TEST_ENV_CHOICE='Fast': expected auto, fast or slow");
  }
  unsetenv(var);
}
