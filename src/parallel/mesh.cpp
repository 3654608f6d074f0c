#include "parallel/mesh.h"

#include <algorithm>
#include <sstream>

#include "core/checked.h"
#include "core/error.h"

namespace origami {

namespace {

// The names of "a-b-c" (views into s: no copies, the planner builds meshes by the million).
std::vector<std::string_view> split_axes(std::string_view s) {
  std::vector<std::string_view> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find('-', start);
    if (end == std::string_view::npos) end = s.size();
    out.emplace_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

}  // namespace

MeshDims MeshShape::derive(int world, MeshDims d) {
  // The products in 64 bits: degrees up to 2^31 each (a product the world cannot hold is refused).
  auto derive_one = [&](int& free, int64_t fixed, const char* what, const char* fixed_what) {
    if (free != 0) return;
    ORIGAMI_CHECK(fixed > 0 && world % fixed == 0, "the world size (", world, " ranks) is not divisible by ", fixed_what,
                  " = ", fixed, ", so ", what, " cannot be derived");
    free = int(world / fixed);
  };
  derive_one(d.dp, int64_t(d.tp) * d.cp * d.pp, "the data-parallel degree", "TP·CP·PP");
  derive_one(d.edp, int64_t(d.etp) * d.ep * d.pp, "the expert data-parallel degree", "ETP·EP·PP");
  return d;
}

MeshShape::MeshShape(int world, MeshDims d, std::string order) : world_(world), dims_(d), order_(std::move(order)) {
  for (auto [name, v] : {std::pair{"tp", d.tp}, {"cp", d.cp}, {"dp", d.dp}, {"pp", d.pp}, {"etp", d.etp}, {"ep", d.ep},
                         {"edp", d.edp}})
    ORIGAMI_CHECK(v >= 1, "parallel degree ", name, " must be at least 1, got ", v);
  // Products of up to four degrees of up to 2^31 each: in checked arithmetic (core/checked.h).
  const Size attn = size_error("TP·CP·DP·PP", "the parallel degrees", [&] { return Size(d.tp) * d.cp * d.dp * d.pp; });
  const Size moe = size_error("ETP·EP·EDP·PP", "the parallel degrees", [&] { return Size(d.etp) * d.ep * d.edp * d.pp; });
  ORIGAMI_CHECK(attn == world, "the world size (", world, " ranks) must equal TP·CP·DP·PP = ", d.tp, "·", d.cp, "·",
                d.dp, "·", d.pp, " = ", attn.get());
  ORIGAMI_CHECK(moe == world, "the world size (", world, " ranks) must equal ETP·EP·EDP·PP for the MoE mesh = ", d.etp,
                "·", d.ep, "·", d.edp, "·", d.pp, " = ", moe.get());
  std::vector<std::string_view> names = split_axes(order_), sorted = names;
  std::sort(sorted.begin(), sorted.end());
  ORIGAMI_CHECK(sorted == std::vector<std::string_view>({"cp", "dp", "ep", "pp", "tp"}), "mesh order '", order_,
                "' must name each of tp, cp, ep, dp, pp exactly once, separated by '-'");
  int sa = 1, sm = 1;
  for (const std::string_view n : names) {
    const int a = n == "tp" ? d.tp : n == "cp" ? d.cp : n == "dp" ? d.dp : n == "pp" ? d.pp : 1;
    const int m = n == "tp" ? d.etp : n == "ep" ? d.ep : n == "dp" ? d.edp : n == "pp" ? d.pp : 1;
    if (n != "ep") attn_.push_back({std::string(n), a, sa});
    if (n != "cp") moe_.push_back({std::string(n == "tp" ? "etp" : n == "dp" ? "edp" : n), m, sm});
    sa *= a, sm *= m;
  }
  auto pp_stride = [](const std::vector<Axis>& mesh) {
    return std::find_if(mesh.begin(), mesh.end(), [](const Axis& x) { return x.name == "pp"; })->stride;
  };
  ORIGAMI_CHECK(pp_stride(attn_) == pp_stride(moe_),
                "mesh order '", order_, "' puts different pipeline groups together in the attention mesh (TP", d.tp,
                " CP", d.cp, " DP", d.dp, ") and the MoE mesh (ETP", d.etp, " EP", d.ep, " EDP", d.edp,
                "): the axes before pp must have the same product in both");
}

const std::vector<MeshShape::Axis>& MeshShape::mesh_of(std::string_view a) const {
  if (a == "etp" || a == "ep" || a == "edp") return moe_;
  ORIGAMI_CHECK(a == "tp" || a == "cp" || a == "dp" || a == "pp", "unknown mesh axis '", a,
                "' (axes: tp, cp, dp, pp, etp, ep, edp)");
  return attn_;
}

const MeshShape::Axis& MeshShape::axis(std::string_view a) const {
  for (const Axis& x : mesh_of(a))
    if (x.name == a) return x;
  fail("internal error: axis ", a, " missing");
}

int MeshShape::degree(std::string_view a) const { return axis(a).size; }

int MeshShape::coord(int rank, std::string_view a) const {
  const Axis& x = axis(a);
  return rank / x.stride % x.size;
}

std::vector<int> MeshShape::group(int rank, std::string_view axes) const {
  const std::vector<std::string_view> names = split_axes(axes);
  const std::vector<Axis>& mesh = mesh_of(names.front());
  std::vector<const Axis*> in;  // the group's axes, in mesh order
  for (const Axis& x : mesh)
    if (std::find(names.begin(), names.end(), x.name) != names.end()) in.push_back(&x);
  ORIGAMI_CHECK(in.size() == names.size(), "axis group '", axes, "' mixes the attention and MoE meshes or repeats an axis");
  int base = rank;  // rank with the group's coordinates zeroed
  for (const Axis* x : in) base -= coord(rank, x->name) * x->stride;
  std::vector<int> ranks{base};
  for (const Axis* x : in) {  // first axis fastest
    std::vector<int> next;
    for (int c = 0; c < x->size; ++c)
      for (int r : ranks) next.push_back(r + c * x->stride);
    ranks = next;
  }
  return ranks;
}

std::string MeshShape::describe(bool experts) const {
  std::ostringstream os;
  const char* sep = "";
  for (auto [name, v] : {std::pair{"TP", dims_.tp}, {"CP", dims_.cp}, {"DP", dims_.dp}, {"PP", dims_.pp}})
    if (v > 1) os << sep << name << v, sep = " x ";
  if (*sep == 0) os << "1 rank";
  if (experts) os << " | experts ETP" << dims_.etp << " x EP" << dims_.ep << " x EDP" << dims_.edp;
  if (order_ != "tp-cp-ep-dp-pp") os << " (order " << order_ << ")";
  return os.str();
}

Mesh::Mesh(Comm& world, MeshShape shape) : world_(world), shape_(std::move(shape)) {
  ORIGAMI_ASSERT(world.size() == shape_.world());
  for (const char* axes : {"tp", "cp", "dp", "pp", "etp", "ep", "edp", "dp-cp", "tp-cp"}) {
    const std::vector<int> g = shape_.group(world.rank(), axes);
    if (const std::string_view a(axes), first = a.substr(0, a.find('-')); first.size() < a.size() &&
        g.size() == shape_.group(world.rank(), first).size()) {  // the other axes have degree 1
      same_as_[std::string(a)] = std::string(first);
      continue;
    }
    const int key = int(std::find(g.begin(), g.end(), world.rank()) - g.begin());
    comms_[axes] = world.split(g.front(), key, axes);  // the group's smallest rank names it
  }
}

Comm& Mesh::comm(std::string_view axes) {
  if (axes == "cp-dp") axes = "dp-cp";
  if (auto same = same_as_.find(axes); same != same_as_.end()) axes = same->second;
  auto it = comms_.find(axes);
  ORIGAMI_CHECK(it != comms_.end(), "internal error: no communicator for axis group '", axes, "'");
  return *it->second;
}

std::map<std::string, double> Mesh::bytes_sent() const {
  std::map<std::string, double> out;
  for (const auto& [name, c] : comms_)
    if (c->bytes_sent() > 0) out[name] = c->bytes_sent();
  if (world_.bytes_sent() > 0) out["world"] = world_.bytes_sent();
  return out;
}

void Mesh::reset_bytes() {
  for (auto& [name, c] : comms_) c->reset_bytes();
  world_.reset_bytes();
}

}  // namespace origami
