#include "data/bpe.h"

#include <cstring>
#include <queue>

namespace origami {

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

namespace {
// The bytes from s[i] that begin a well-formed UTF-8 character (Unicode Table 3-7: the length and the
// range of the second byte of each lead byte), and in *len the length its lead byte calls for (0: not
// a lead byte). A character is whole when they are equal; fewer at the end of the bytes may be one cut.
size_t valid_prefix(const unsigned char* s, size_t i, size_t n, int* len) {
  const unsigned char c = s[i];
  unsigned char lo = 0x80, hi = 0xBF;
  *len = 0;
  if (c < 0x80) *len = 1;
  else if (c >= 0xC2 && c <= 0xDF) *len = 2;
  else if (c >= 0xE0 && c <= 0xEF) *len = 3, lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
  else if (c >= 0xF0 && c <= 0xF4) *len = 4, lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
  size_t k = 1;
  for (; *len > 0 && k < size_t(*len) && i + k < n; ++k) {
    const unsigned char b = s[i + k];
    if (k == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) break;
  }
  return k;
}
}  // namespace

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  const auto* s = reinterpret_cast<const unsigned char*>(bytes.data());
  for (size_t i = 0; i < bytes.size();) {
    int len = 0;
    const size_t k = valid_prefix(s, i, bytes.size(), &len);
    if (size_t(len) == k) out.append(bytes.substr(i, k));
    else out += "\xEF\xBF\xBD";  // U+FFFD for the maximal invalid subpart
    i += k;
  }
  return out;
}

size_t utf8_whole_prefix(std::string_view bytes) {
  const auto* s = reinterpret_cast<const unsigned char*>(bytes.data());
  for (size_t i = 0; i < bytes.size();) {
    int len = 0;
    const size_t k = valid_prefix(s, i, bytes.size(), &len);
    if (i + k == bytes.size() && k < size_t(len)) return i;  // a character cut at the end
    i += k;
  }
  return bytes.size();
}

const std::array<std::string, 256>& byte_level_symbols() {
  static const std::array<std::string, 256> sym = [] {
    std::array<std::string, 256> s;
    for (int b = 0; b < 256; ++b) append_utf8(s[b], gpt2_byte_to_unicode()[b]);
    return s;
  }();
  return sym;
}

void BpeMerges::reserve(size_t n) {
  while (slots_.size() < 2 * n) grow();
}

void BpeMerges::grow() {
  std::vector<Slot> old = std::move(slots_);
  slots_.assign(old.size() * 2, Slot{});
  --shift_;
  for (const Slot& s : old) {
    if (s.key == kEmpty) continue;
    size_t i = slot_of(s.key);
    while (slots_[i].key != kEmpty) i = (i + 1) & (slots_.size() - 1);
    slots_[i] = s;
  }
}

void BpeMerges::add(int32_t left, int32_t right, int32_t result) {
  if (2 * (size_ + 1) > slots_.size()) grow();
  const uint64_t k = key(left, right);
  size_t i = slot_of(k);
  while (slots_[i].key != kEmpty && slots_[i].key != k) i = (i + 1) & (slots_.size() - 1);
  if (slots_[i].key == kEmpty) ++size_;
  slots_[i] = Slot{k, Merge{next_rank_++, result}};  // a repeated pair keeps its last rank
}

// A heap of candidate merges with lazy deletion over a linked list of symbols.
void BpeMerges::apply(std::vector<int32_t>& ids, size_t begin) const {
  const int n = int(ids.size() - begin);
  if (n < 2) return;
  int32_t* v = ids.data() + begin;
  struct Sym {
    int32_t prev, next;
  };
  std::vector<Sym> sym(n);
  for (int i = 0; i < n; ++i) sym[i] = {i - 1, i + 1 < n ? i + 1 : -1};
  struct Cand {
    int32_t rank, pos;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::vector<Cand> storage;
  storage.reserve(size_t(n));
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap(std::greater<Cand>(), std::move(storage));
  for (int i = 0; i + 1 < n; ++i)
    if (const Merge* m = find(v[i], v[i + 1])) heap.push({m->rank, i});
  constexpr int32_t kDead = -2;
  while (!heap.empty()) {
    Cand c = heap.top();
    heap.pop();
    Sym& s = sym[c.pos];
    if (s.next == kDead || s.next < 0) continue;
    const Merge* m = find(v[c.pos], v[s.next]);
    if (!m || m->rank != c.rank) continue;  // stale: a neighbour was merged since
    const int right = s.next;
    s.next = sym[right].next;
    sym[right].next = kDead;
    v[c.pos] = m->id;
    if (s.next >= 0) sym[s.next].prev = c.pos;
    if (s.prev >= 0)
      if (const Merge* mp = find(v[s.prev], v[c.pos])) heap.push({mp->rank, s.prev});
    if (s.next >= 0)
      if (const Merge* mn = find(v[c.pos], v[s.next])) heap.push({mn->rank, c.pos});
  }
  size_t out = begin;
  for (int i = 0; i >= 0; i = sym[i].next) ids[out++] = v[i];
  ids.resize(out);
}

std::atomic<uint64_t> PieceCache::next_owner_{0};

namespace {
constexpr int kMinCacheBits = 12, kMaxCacheBits = 21;  // a table at most half full
// The arena's bytes (keys and ids) at most: 2^20 pieces of ~6 bytes and ~2 ids take ~15 MiB, but
// long unique pieces (CJK, code) up to 1.3 GiB a thread, on every thread `data prepare` runs.
constexpr size_t kMaxArenaBytes = size_t(64) << 20;
}

void PieceCache::Local::clear() {
  slots.assign(size_t(1) << kMinCacheBits, Slot{0, 0, 0, kEmpty});
  bits = kMinCacheBits;
  arena.clear();
  count = 0;
}

bool PieceCache::Local::append(std::string_view piece, uint64_t h, std::vector<int32_t>& out) const {
  const size_t mask = slots.size() - 1;
  for (size_t i = size_t(h >> (64 - bits));; i = (i + 1) & mask) {
    const Slot& s = slots[i];
    if (s.num_ids == kEmpty) return false;
    if (s.hash == h && s.key_len == piece.size() && std::memcmp(arena.data() + s.offset, piece.data(), piece.size()) == 0) {
      const size_t at = out.size();
      out.resize(at + s.num_ids);
      std::memcpy(out.data() + at, arena.data() + s.offset + s.key_len, s.num_ids * sizeof(int32_t));
      return true;
    }
  }
}

void PieceCache::Local::place(const Slot& slot) {
  const size_t mask = slots.size() - 1;
  size_t i = size_t(slot.hash >> (64 - bits));
  while (slots[i].num_ids != kEmpty) i = (i + 1) & mask;
  slots[i] = slot;
}

void PieceCache::Local::insert(std::string_view piece, uint64_t h, const int32_t* ids, size_t n) {
  if (arena.size() + piece.size() + n * sizeof(int32_t) > kMaxArenaBytes) {
    clear();
  } else if (2 * (count + 1) > slots.size()) {
    if (bits == kMaxCacheBits) {
      clear();
    } else {
      std::vector<Slot> old = std::move(slots);
      slots.assign(old.size() * 2, Slot{0, 0, 0, kEmpty});
      ++bits;
      for (const Slot& s : old)
        if (s.num_ids != kEmpty) place(s);
    }
  }
  place(Slot{h, arena.size(), uint32_t(piece.size()), uint32_t(n)});
  arena.append(piece);
  arena.append(reinterpret_cast<const char*>(ids), n * sizeof(int32_t));
  ++count;
}

PieceCache::Local& PieceCache::this_thread(uint64_t owner) {
  thread_local Local local;
  if (local.owner != owner) {
    local.clear();
    local.owner = owner;
  }
  return local;
}

}  // namespace origami
