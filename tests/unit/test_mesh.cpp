// MeshShape: coordinates and groups of the two meshes over the same ranks, computed by hand from
// the rule "the first axis of the order string varies fastest" (src/parallel/mesh.h). No MPI.
//
// With order tp-cp-ep-dp-pp a rank's attention-mesh coordinates satisfy
//   rank = tp + TP·(cp + CP·(dp + DP·pp))        (ep is absent from the attention mesh)
// and its MoE-mesh coordinates
//   rank = etp + ETP·(ep + EP·(edp + EDP·pp))    (cp is absent from the MoE mesh)
// A group over some axes is the set of ranks that agree with `rank` on every other axis of that
// mesh, listed with the group's first axis (in mesh order) varying fastest.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.h"
#include "parallel/mesh.h"

using origami::MeshDims;
using origami::MeshShape;
using V = std::vector<int>;

namespace {

MeshDims dims(int tp, int cp, int dp, int pp, int etp, int ep, int edp) {
  MeshDims d;
  d.tp = tp, d.cp = cp, d.dp = dp, d.pp = pp, d.etp = etp, d.ep = ep, d.edp = edp;
  return d;
}

// Whether constructing the mesh throws origami::Error whose message contains `needle`.
bool throws_with(int world, MeshDims d, const std::string& order, const std::string& needle) {
  try {
    MeshShape m(world, d, order);
  } catch (const origami::Error& e) {
    return std::string(e.what()).find(needle) != std::string::npos;
  }
  return false;
}

}  // namespace

// 8 ranks, attention mesh TP2 × DP2 × PP2 (CP1), MoE mesh ETP2 × EP1 × EDP2 × PP2 (the plain
// dense case: the MoE mesh mirrors the attention mesh).
//   rank = tp + 2·dp + 4·pp, so rank 5 = 1 + 2·0 + 4·1 → (tp 1, dp 0, pp 1).
TEST(MeshShape, CoordinatesAndGroupsTp2Dp2Pp2) {
  MeshShape m(8, dims(2, 1, 2, 2, 2, 1, 2));
  EXPECT_EQ(m.world(), 8);
  EXPECT_EQ(m.degree("tp"), 2);
  EXPECT_EQ(m.degree("cp"), 1);
  EXPECT_EQ(m.degree("dp"), 2);
  EXPECT_EQ(m.degree("pp"), 2);
  EXPECT_EQ(m.coord(5, "tp"), 1);
  EXPECT_EQ(m.coord(5, "cp"), 0);
  EXPECT_EQ(m.coord(5, "dp"), 0);
  EXPECT_EQ(m.coord(5, "pp"), 1);
  // Every rank: coordinates recompose the rank.
  for (int r = 0; r < 8; ++r)
    EXPECT_EQ(m.coord(r, "tp") + 2 * m.coord(r, "dp") + 4 * m.coord(r, "pp"), r) << "rank " << r;
  // tp group of 5: dp 0, pp 1 fixed, tp ∈ {0,1} → 4 + {0,1}.
  EXPECT_EQ(m.group(5, "tp"), (V{4, 5}));
  // dp group of 5: tp 1, pp 1 fixed → 1 + 4 + 2·{0,1}.
  EXPECT_EQ(m.group(5, "dp"), (V{5, 7}));
  // pp group of 5: tp 1, dp 0 fixed → 1 + 4·{0,1}.
  EXPECT_EQ(m.group(5, "pp"), (V{1, 5}));
  EXPECT_EQ(m.group(5, "cp"), (V{5}));
  // CP1: the gradient-reduction group dp-cp is the dp group.
  EXPECT_EQ(m.group(5, "dp-cp"), (V{5, 7}));
  EXPECT_EQ(m.group(2, "dp-cp"), (V{0, 2}));
  // Two axes: tp fastest (first in mesh order), whatever order the caller names them in.
  EXPECT_EQ(m.group(5, "tp-dp"), (V{4, 5, 6, 7}));
  EXPECT_EQ(m.group(5, "dp-tp"), (V{4, 5, 6, 7}));
  EXPECT_EQ(m.group(2, "tp-pp"), (V{2, 3, 6, 7}));
  // MoE mesh mirrors it: etp ≡ tp, edp ≡ dp, ep = 1.
  EXPECT_EQ(m.group(5, "etp"), (V{4, 5}));
  EXPECT_EQ(m.group(5, "edp"), (V{5, 7}));
  EXPECT_EQ(m.group(5, "ep"), (V{5}));
  EXPECT_EQ(m.describe().find("TP2 x DP2 x PP2"), 0u) << m.describe();
}

// Expert mesh with EP2: attention TP2 × DP2 × PP2, MoE ETP1 × EP2 × EDP2 × PP2.
// MoE axes in order tp→etp (size 1, stride 1), ep (2, stride 1), dp→edp (2, stride 2), pp (2, stride 4):
//   rank = ep + 2·edp + 4·pp; rank 5 → (etp 0, ep 1, edp 0, pp 1).
// The pipeline stride is 4 in both meshes (TP·CP·DP = ETP·EP·EDP = 4), so the pp groups agree.
TEST(MeshShape, ExpertMeshEp2) {
  MeshShape m(8, dims(2, 1, 2, 2, 1, 2, 2));
  EXPECT_EQ(m.degree("etp"), 1);
  EXPECT_EQ(m.degree("ep"), 2);
  EXPECT_EQ(m.degree("edp"), 2);
  EXPECT_EQ(m.coord(5, "etp"), 0);
  EXPECT_EQ(m.coord(5, "ep"), 1);
  EXPECT_EQ(m.coord(5, "edp"), 0);
  EXPECT_EQ(m.coord(5, "pp"), 1);
  for (int r = 0; r < 8; ++r)
    EXPECT_EQ(m.coord(r, "ep") + 2 * m.coord(r, "edp") + 4 * m.coord(r, "pp"), r) << "rank " << r;
  // ep group of 5: edp 0, pp 1 fixed → 4 + {0,1}. It spans the same ranks as the attention tp group.
  EXPECT_EQ(m.group(5, "ep"), (V{4, 5}));
  EXPECT_EQ(m.group(5, "etp"), (V{5}));
  // edp group of 5: ep 1, pp 1 fixed → 5 + 2·{0,1}.
  EXPECT_EQ(m.group(5, "edp"), (V{5, 7}));
  EXPECT_EQ(m.group(5, "etp-ep"), (V{4, 5}));
  EXPECT_EQ(m.group(6, "ep-edp"), (V{4, 5, 6, 7}));
  // Attention-mesh groups are unchanged by the MoE dims.
  EXPECT_EQ(m.group(5, "tp"), (V{4, 5}));
  EXPECT_EQ(m.group(5, "dp"), (V{5, 7}));
  EXPECT_EQ(m.group(5, "pp"), (V{1, 5}));
  EXPECT_NE(m.describe(true).find("experts ETP1 x EP2"), std::string::npos) << m.describe(true);
  EXPECT_EQ(m.describe().find("EP"), std::string::npos) << m.describe();
  // An axis group may not mix the meshes.
  EXPECT_THROW(m.group(5, "tp-ep"), origami::Error);
  EXPECT_THROW(m.group(5, "xx"), origami::Error);
  EXPECT_THROW(m.degree("xx"), origami::Error);
}

// Context parallelism: TP2 × CP2 × DP2 (8 ranks), rank = tp + 2·cp + 4·dp.
// Rank 3 = (tp 1, cp 1, dp 0). Dense gradients are reduced over dp-cp = the ranks with tp 1 and
// any (cp, dp), cp fastest: 1 + 2·cp + 4·dp → 1, 3, 5, 7.
TEST(MeshShape, DataWithContextGroup) {
  MeshShape m(8, dims(2, 2, 2, 1, 2, 1, 4));
  EXPECT_EQ(m.coord(3, "tp"), 1);
  EXPECT_EQ(m.coord(3, "cp"), 1);
  EXPECT_EQ(m.coord(3, "dp"), 0);
  EXPECT_EQ(m.group(3, "cp"), (V{1, 3}));
  EXPECT_EQ(m.group(3, "dp"), (V{3, 7}));
  EXPECT_EQ(m.group(3, "dp-cp"), (V{1, 3, 5, 7}));
  EXPECT_EQ(m.group(6, "cp"), (V{4, 6}));
  // MoE mesh ETP2 × EDP4 (cp folds into edp): rank = etp + 2·edp, edp group of 3 = 1 + 2·{0..3}.
  EXPECT_EQ(m.group(3, "edp"), (V{1, 3, 5, 7}));
}

// A different order: "dp-tp-cp-ep-pp" puts dp fastest: rank = dp + DP·tp + DP·TP·pp.
// With TP2 × DP2 × PP2, rank 5 = 1 + 2·0 + 4·1 → (dp 1, tp 0, pp 1).
TEST(MeshShape, OrderStringChangesWhichAxisIsFastest) {
  MeshShape m(8, dims(2, 1, 2, 2, 2, 1, 2), "dp-tp-cp-ep-pp");
  EXPECT_EQ(m.coord(5, "dp"), 1);
  EXPECT_EQ(m.coord(5, "tp"), 0);
  EXPECT_EQ(m.coord(5, "pp"), 1);
  EXPECT_EQ(m.group(5, "dp"), (V{4, 5}));
  EXPECT_EQ(m.group(5, "tp"), (V{5, 7}));
  EXPECT_EQ(m.group(5, "pp"), (V{1, 5}));
}

TEST(MeshShape, Derive) {
  MeshDims d = MeshShape::derive(8, dims(2, 1, 0, 2, 1, 2, 0));
  EXPECT_EQ(d.dp, 2);   // 8 / (TP2·CP1·PP2)
  EXPECT_EQ(d.edp, 2);  // 8 / (ETP1·EP2·PP2)
  MeshDims e = MeshShape::derive(4, dims(2, 1, 0, 1, 2, 1, 0));
  EXPECT_EQ(e.dp, 2);
  EXPECT_EQ(e.edp, 2);
  // Given degrees are kept.
  MeshDims f = MeshShape::derive(4, dims(1, 1, 4, 1, 1, 1, 4));
  EXPECT_EQ(f.dp, 4);
  // 6 ranks are not divisible by TP4.
  EXPECT_THROW(MeshShape::derive(6, dims(4, 1, 0, 1, 4, 1, 0)), origami::Error);
}

TEST(MeshShape, Errors) {
  // World ≠ TP·CP·DP·PP (2·1·2·1 = 4 ≠ 8); the message shows the product.
  EXPECT_TRUE(throws_with(8, dims(2, 1, 2, 1, 2, 1, 2), "tp-cp-ep-dp-pp", "= 4"));
  // World ≠ ETP·EP·EDP·PP for the MoE mesh (1·2·1·2 = 4 ≠ 8) while the attention mesh is right.
  EXPECT_TRUE(throws_with(8, dims(2, 1, 2, 2, 1, 2, 1), "tp-cp-ep-dp-pp", "MoE"));
  // Degrees below 1.
  EXPECT_TRUE(throws_with(8, dims(0, 1, 8, 1, 1, 1, 8), "tp-cp-ep-dp-pp", "at least 1"));
  // Bad order strings: an axis missing, repeated, unknown, or no separators.
  const MeshDims ok = dims(2, 1, 2, 2, 2, 1, 2);
  for (const char* order : {"tp-cp-dp-pp", "tp-cp-ep-dp-pp-tp", "tp-cp-ep-dp-xx", "", "tpcpepdppp", "tp-cp-ep-dp-pp-"})
    EXPECT_TRUE(throws_with(8, ok, order, "must name each of tp, cp, ep, dp, pp")) << "order '" << order << "'";
  // Pipeline groups differing between the meshes: with order tp-cp-dp-pp-ep and MoE ETP1 × EP2 × EDP2,
  // the attention pp stride is TP·CP·DP = 4 but the MoE pp stride is ETP·EDP = 2 (ep comes after pp),
  // so rank 1 would be in pp group {1,5} of one mesh and {1,3} of the other.
  EXPECT_TRUE(throws_with(8, dims(2, 1, 2, 2, 1, 2, 2), "tp-cp-dp-pp-ep", "pipeline groups"));
  // The same order is fine when EP = 1 (strides 4 and 4).
  EXPECT_NO_THROW(MeshShape(8, dims(2, 1, 2, 2, 2, 1, 2), "tp-cp-dp-pp-ep"));
}
