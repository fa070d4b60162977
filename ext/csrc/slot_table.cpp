#include "slot_table.h"

#include <algorithm>
#include <stdexcept>
#include <tuple>

namespace anchorcache {
namespace {

void check_key(const std::string& key, const char* what) {
  if (key.size() != kKeyBytes) {
    throw std::invalid_argument(std::string("anchorcache: ") + what + " must be 16 bytes, got " +
                                std::to_string(key.size()));
  }
}

}  // namespace

SlotTable::SlotTable(int64_t num_slots, int64_t capacity_bytes, int64_t slot_base,
                     int64_t pinned_slots)
    : num_slots_(num_slots),
      capacity_bytes_(capacity_bytes),
      slot_base_(slot_base),
      pinned_slots_(pinned_slots) {
  if (num_slots <= 0) throw std::invalid_argument("anchorcache: num_slots must be positive");
  if (capacity_bytes < 0) throw std::invalid_argument("anchorcache: capacity_bytes must be >= 0");
  if (slot_base < 0 || pinned_slots < 0 || slot_base + pinned_slots > num_slots) {
    throw std::invalid_argument(
        "anchorcache: thin region [slot_base, slot_base + pinned_slots) must lie within "
        "[0, num_slots)");
  }
  slots_.resize(static_cast<size_t>(num_slots));
}

bool SlotTable::in_thin(int64_t slot) const {
  return slot >= slot_base_ && slot < slot_base_ + pinned_slots_;
}

void SlotTable::check_slot(int64_t slot) const {
  if (slot < 0 || slot >= num_slots_) {
    throw std::out_of_range("anchorcache: slot " + std::to_string(slot) + " out of range [0, " +
                            std::to_string(num_slots_) + ")");
  }
}

std::optional<int64_t> SlotTable::valid_slot(const std::string& key) const {
  auto it = index_.find(key);
  if (it == index_.end()) return std::nullopt;
  const Slot& s = slots_[it->second.slot];
  if (!s.committed || s.committed->key != key || s.committed->depth != it->second.depth) {
    return std::nullopt;
  }
  return it->second.slot;
}

std::vector<int64_t> SlotTable::ancestors(int64_t slot) const {
  // The walk visits each slot at most once (`slot` included), so it ends within num_slots
  // steps even when parents form a cycle. Chains are a few links: a linear search is enough.
  std::vector<int64_t> chain;
  const SlotEntry* e = &*slots_[slot].committed;
  while (e->parent) {
    std::optional<int64_t> up = valid_slot(*e->parent);
    if (!up || *up == slot || std::find(chain.begin(), chain.end(), *up) != chain.end()) break;
    chain.push_back(*up);
    e = &*slots_[*up].committed;
  }
  return chain;
}

void SlotTable::touch(int64_t slot) {
  // Ancestors end strictly newer than their descendants: LRU reaches a chain's leaf first.
  slots_[slot].committed->last_use = ++clock_;
  for (int64_t up : ancestors(slot)) slots_[up].committed->last_use = ++clock_;
}

std::vector<char> SlotTable::protected_slots() const {
  std::vector<char> is_protected(static_cast<size_t>(num_slots_), 0);
  for (int64_t i = 0; i < num_slots_; ++i) {
    if (!slots_[i].committed || !slots_[i].committed->pinned) continue;
    for (int64_t up : ancestors(i)) is_protected[up] = 1;
  }
  return is_protected;
}

bool SlotTable::evictable(int64_t slot, const std::vector<char>& is_protected) const {
  const Slot& s = slots_[slot];
  return s.committed.has_value() && !s.committed->pinned && !s.claimed_by.has_value() &&
         !s.pending.has_value() && !is_protected[slot];
}

std::optional<int64_t> SlotTable::lru_victim(bool thin, const std::vector<char>& taken,
                                             const std::vector<char>& is_protected) const {
  std::optional<int64_t> best;
  for (int64_t i = 0; i < num_slots_; ++i) {
    if (taken[i] || in_thin(i) != thin || !evictable(i, is_protected)) continue;
    // Ties cannot happen (every touch takes fresh ticks); lowest slot wins anyway.
    if (!best || slots_[i].committed->last_use < slots_[*best].committed->last_use) best = i;
  }
  return best;
}

void SlotTable::drop_committed(int64_t slot) {
  Slot& s = slots_[slot];
  if (!s.committed) return;
  auto it = index_.find(s.committed->key);
  if (it != index_.end() && it->second.slot == slot) index_.erase(it);
  bytes_used_ -= s.committed->nbytes;
  if (s.claimed_by) bytes_claimed_ -= s.committed->nbytes;
  s.committed.reset();
  s.claimed_by.reset();
  ++evictions_;
}

std::optional<SlotReservation> SlotTable::reserve(const std::string& key, int64_t depth,
                                                  int64_t nbytes,
                                                  const std::optional<std::string>& parent,
                                                  Region region, std::optional<int64_t> slot) {
  check_key(key, "key");
  if (parent) check_key(*parent, "parent");
  if (depth < 0 || nbytes < 0) {
    throw std::invalid_argument("anchorcache: depth and nbytes must be >= 0");
  }
  if (slot) check_slot(*slot);
  std::lock_guard<std::mutex> lock(mu_);
  if (index_.count(key) || pending_keys_.count(key)) return std::nullopt;

  const std::vector<char> is_protected = protected_slots();
  // Claims are applied at the end, so candidates are marked as taken while searching.
  std::vector<char> taken(static_cast<size_t>(num_slots_), 0);
  int64_t chosen = -1;
  if (slot) {
    const Slot& s = slots_[*slot];
    if (s.pending) return std::nullopt;
    if (s.committed && (s.committed->pinned || s.claimed_by || is_protected[*slot])) {
      return std::nullopt;
    }
    chosen = *slot;
  } else {
    const bool thin = region == Region::kThin;
    for (int64_t i = 0; i < num_slots_ && chosen < 0; ++i) {
      if (in_thin(i) == thin && !slots_[i].committed && !slots_[i].pending) chosen = i;
    }
    if (chosen < 0) {
      std::optional<int64_t> lru = lru_victim(thin, taken, is_protected);
      if (!lru) return std::nullopt;
      chosen = *lru;
    }
  }
  taken[chosen] = 1;

  std::vector<int64_t> victim_slots;
  int64_t freed = 0;
  if (slots_[chosen].committed) {
    victim_slots.push_back(chosen);
    freed += slots_[chosen].committed->nbytes;
  }
  // Bytes as they will be once every pending reservation (this one included) is confirmed.
  auto projected = [&] { return bytes_used_ - bytes_claimed_ + bytes_reserved_ + nbytes - freed; };
  // Secondary victims for bytes: LRU of the chosen slot's region first, then the other one.
  for (bool thin : {in_thin(chosen), !in_thin(chosen)}) {
    while (projected() > capacity_bytes_) {
      std::optional<int64_t> best = lru_victim(thin, taken, is_protected);
      if (!best) break;
      taken[*best] = 1;
      victim_slots.push_back(*best);
      freed += slots_[*best].committed->nbytes;
    }
  }
  if (projected() > capacity_bytes_) return std::nullopt;

  SlotReservation result{chosen, {}};
  Pending pending;
  pending.entry = SlotEntry{key, depth, parent, nbytes, false, 0, 0};
  for (int64_t v : victim_slots) {
    Slot& s = slots_[v];
    s.claimed_by = chosen;
    bytes_claimed_ += s.committed->nbytes;
    pending.victims.push_back(Victim{s.committed->key, v});
    result.victims.push_back(s.committed->key);
  }
  slots_[chosen].pending = std::move(pending);
  pending_keys_[key] = chosen;
  bytes_reserved_ += nbytes;
  ++reservations_;
  return result;
}

std::vector<std::string> SlotTable::confirm(int64_t slot) {
  check_slot(slot);
  std::lock_guard<std::mutex> lock(mu_);
  Slot& s = slots_[slot];
  if (!s.pending) {
    throw std::invalid_argument("anchorcache: confirm of slot " + std::to_string(slot) +
                                " which holds no reservation");
  }
  Pending pending = std::move(*s.pending);
  s.pending.reset();
  std::vector<std::string> evicted;
  for (const Victim& v : pending.victims) {
    const Slot& vs = slots_[v.slot];
    if (vs.committed && vs.committed->key == v.key && vs.claimed_by == slot) {
      drop_committed(v.slot);
      evicted.push_back(v.key);
    }
  }
  if (s.committed) {  // an occupant that was not claimed (cannot happen; kept as a guard)
    evicted.push_back(s.committed->key);
    drop_committed(slot);
  }
  // Any other key still mapped to this slot would now point at foreign data.
  for (auto it = index_.begin(); it != index_.end();) {
    if (it->second.slot == slot) {
      evicted.push_back(it->first);
      it = index_.erase(it);
      ++evictions_;
    } else {
      ++it;
    }
  }
  SlotEntry entry = std::move(pending.entry);
  bytes_reserved_ -= entry.nbytes;
  bytes_used_ += entry.nbytes;
  pending_keys_.erase(entry.key);
  index_[entry.key] = MapEntry{slot, entry.depth};
  s.committed = std::move(entry);
  touch(slot);  // after the victims are gone: an evicted parent ends the walk
  ++confirms_;
  return evicted;
}

void SlotTable::abort(int64_t slot) {
  check_slot(slot);
  std::lock_guard<std::mutex> lock(mu_);
  Slot& s = slots_[slot];
  if (!s.pending) {
    throw std::invalid_argument("anchorcache: abort of slot " + std::to_string(slot) +
                                " which holds no reservation");
  }
  for (const Victim& v : s.pending->victims) {
    Slot& vs = slots_[v.slot];
    if (vs.committed && vs.committed->key == v.key && vs.claimed_by == slot) {
      vs.claimed_by.reset();
      bytes_claimed_ -= vs.committed->nbytes;
    }
  }
  bytes_reserved_ -= s.pending->entry.nbytes;
  pending_keys_.erase(s.pending->entry.key);
  s.pending.reset();
  ++aborts_;
}

std::optional<int64_t> SlotTable::lookup(const std::string& key, int64_t depth) {
  check_key(key, "key");
  std::lock_guard<std::mutex> lock(mu_);
  auto it = index_.find(key);
  if (it == index_.end()) {
    ++misses_;
    return std::nullopt;
  }
  std::optional<int64_t> slot = valid_slot(key);
  if (!slot) {
    index_.erase(it);
    ++stale_evictions_;
    ++misses_;
    return std::nullopt;
  }
  SlotEntry& e = *slots_[*slot].committed;
  if (e.depth != depth) {  // same hash, other depth: never restore it
    ++misses_;
    return std::nullopt;
  }
  touch(*slot);
  ++e.hits;
  ++hits_;
  return slot;
}

bool SlotTable::contains(const std::string& key, int64_t depth) const {
  check_key(key, "key");
  std::lock_guard<std::mutex> lock(mu_);
  std::optional<int64_t> slot = valid_slot(key);
  return slot && slots_[*slot].committed->depth == depth;
}

bool SlotTable::pin(const std::string& key) {
  check_key(key, "key");
  std::lock_guard<std::mutex> lock(mu_);
  std::optional<int64_t> slot = valid_slot(key);
  if (!slot || slots_[*slot].claimed_by) return false;
  // A claimed ancestor goes at its claimer's confirm: the pin could not keep the chain.
  for (int64_t up : ancestors(*slot)) {
    if (slots_[up].claimed_by) return false;
  }
  slots_[*slot].committed->pinned = true;
  return true;
}

bool SlotTable::unpin(const std::string& key) {
  check_key(key, "key");
  std::lock_guard<std::mutex> lock(mu_);
  std::optional<int64_t> slot = valid_slot(key);
  if (!slot) return false;
  slots_[*slot].committed->pinned = false;
  return true;
}

bool SlotTable::evict(const std::string& key) {
  check_key(key, "key");
  std::lock_guard<std::mutex> lock(mu_);
  std::optional<int64_t> slot = valid_slot(key);
  if (!slot) return false;
  drop_committed(*slot);
  return true;
}

std::vector<std::string> SlotTable::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> evicted;
  for (int64_t i = 0; i < num_slots_; ++i) {
    if (slots_[i].committed) {
      evicted.push_back(slots_[i].committed->key);
      drop_committed(i);
    }
  }
  index_.clear();
  return evicted;
}

std::vector<SlotListing> SlotTable::entries() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<SlotListing> out;
  for (int64_t i = 0; i < num_slots_; ++i) {
    const Slot& s = slots_[i];
    if (s.committed) out.push_back(SlotListing{i, *s.committed, false});
    if (s.pending) out.push_back(SlotListing{i, s.pending->entry, true});
  }
  return out;
}

SlotTableStats SlotTable::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  SlotTableStats st{};
  st.num_slots = num_slots_;
  for (const Slot& s : slots_) {
    if (s.committed) ++st.used_slots;
    if (s.pending) ++st.reserved_slots;
    if (!s.committed && !s.pending) ++st.free_slots;
  }
  st.bytes_used = bytes_used_;
  st.bytes_reserved = bytes_reserved_;
  st.bytes_capacity = capacity_bytes_;
  st.hits = hits_;
  st.misses = misses_;
  st.stale_evictions = stale_evictions_;
  st.reservations = reservations_;
  st.confirms = confirms_;
  st.aborts = aborts_;
  st.evictions = evictions_;
  return st;
}

}  // namespace anchorcache
