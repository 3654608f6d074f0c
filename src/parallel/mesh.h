// The device mesh: the world's ranks arranged along named axes, two ways over the same ranks
// (MoE parallel folding):
//   attention / dense mesh  tp × cp × dp × pp
//   MoE mesh                etp × ep × edp × pp   (same pipeline groups)
// The order string names the five axes tp, cp, ep, dp, pp, first varying fastest (Megatron's
// RankGenerator convention; default "tp-cp-ep-dp-pp"). The attention mesh reads it with ep = 1,
// the MoE mesh with tp → etp, cp = 1, dp → edp.
//
// MeshShape is the pure part (degrees, coordinates, groups of any rank; no communication) so
// the planner and the tests can use it without MPI. Mesh adds one communicator per axis group,
// created collectively once. Both are values passed explicitly: there is no global parallel state.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "comm/comm.h"

namespace origami {

struct MeshDims {
  int tp = 1, cp = 1, dp = 1, pp = 1;  // attention mesh
  int etp = 1, ep = 1, edp = 1;        // MoE mesh
};

class MeshShape {
 public:
  // Validates once: world = tp·cp·dp·pp = etp·ep·edp·pp, the order is a permutation of the five axis
  // names, and both meshes put the same pipeline groups together. Throws Error naming the rule.
  MeshShape(int world, MeshDims dims, std::string order = "tp-cp-ep-dp-pp");
  // Fills dp (and edp) from the world size when they are 0: dp = world/(tp·cp·pp), edp = world/(etp·ep·pp).
  static MeshDims derive(int world, MeshDims dims);

  int world() const { return world_; }
  const MeshDims& dims() const { return dims_; }
  const std::string& order() const { return order_; }
  // Degree of an axis: tp, cp, dp, pp (attention mesh), etp, ep, edp (MoE mesh).
  int degree(std::string_view axis) const;
  int coord(int rank, std::string_view axis) const;
  // The ranks sharing every coordinate of `rank` except those of `axes` ("tp", "dp-cp", "etp-ep", ...;
  // all from one mesh), ordered by their coordinates along `axes` (first fastest in mesh order).
  std::vector<int> group(int rank, std::string_view axes) const;
  // e.g. "TP2 x DP2" (the attention mesh), with `experts` also the MoE mesh ("TP2 x DP2 | experts
  // ETP1 x EP4 x EDP1"), and " (order dp-tp-cp-ep-pp)" when the order is not the default.
  std::string describe(bool experts = false) const;

 private:
  struct Axis {
    std::string name;
    int size, stride;
  };
  const std::vector<Axis>& mesh_of(std::string_view axis) const;
  const Axis& axis(std::string_view name) const;
  int world_;
  MeshDims dims_;
  std::string order_;
  std::vector<Axis> attn_, moe_;  // in order, first fastest, with strides
};

class Mesh {
 public:
  // Collective over `world`: creates the communicators of every axis (tp, cp, dp, pp, etp, ep,
  // edp) and of two groups: dp-cp (dense gradients are reduced over data and context parallel) and
  // tp-cp (the tokens MoE layers route). A group that spans no more ranks than one of its axes (cp
  // of 1) is that axis's communicator, so its traffic is reported under the axis's name.
  Mesh(Comm& world, MeshShape shape);
  const MeshShape& shape() const { return shape_; }
  int rank() const { return world_.rank(); }
  int coord(std::string_view axis) const { return shape_.coord(world_.rank(), axis); }
  int degree(std::string_view axis) const { return shape_.degree(axis); }
  Comm& world() { return world_; }
  Comm& comm(std::string_view axes);
  // Bytes this rank sent per axis group (and "world") since the last reset (zero entries omitted).
  std::map<std::string, double> bytes_sent() const;
  void reset_bytes();

 private:
  Comm& world_;
  MeshShape shape_;
  std::map<std::string, std::unique_ptr<Comm>, std::less<>> comms_;
  std::map<std::string, std::string, std::less<>> same_as_;  // group → the axis it equals
};

}  // namespace origami
