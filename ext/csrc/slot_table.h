// Slot table: which anchor (16-byte prefix key + depth) occupies which snapshot slot.
//
// Bookkeeping only: slab memory belongs to the caller (the worker keeps slot -> slab). Slots
// [slot_base, slot_base + pinned_slots) form the thin region (tool anchors), the rest the
// thick region; each region is reused least-recently-used among evictable slots.
//
// Anchors chain: an entry may name a `parent` key (a child stores only the rows past its
// parent). Its ancestors are the walk parent key -> the slot where that key is committed and
// not stale -> that entry's parent -> ..., stopping at a missing or stale parent and at a slot
// already on the walk (keys are arbitrary: a parent may name a descendant).
//
// Invariants (checked by tests/ext/test_slot_table*.py against a Python model):
// - A key is visible to lookup only once committed (confirm), and only while the slot's
//   committed (key, depth) equals the key's map entry; anything else is a stale map entry,
//   evicted on sight.
// - Touching an entry (its commit, a lookup hit) gives it a fresh clock tick, then each of its
//   ancestors a fresher one (child t, parent t + 1, ...); only the entry's own hits grow. So
//   outside cycles a parent is always newer than its child, and LRU evicts leaves first.
// - reserve() evicts nothing: it claims victims (the slot's occupant, then LRU slots of the
//   same region, then of the other region, until the bytes fit). Claimed victims stay
//   visible; confirm() evicts them and every other key mapped to the slot; abort() releases
//   them, so a failed snapshot never costs the old anchor.
// - Evictable: committed, not pinned, not claimed, no pending reservation, and not an ancestor
//   of a committed pinned entry (protected). Only evictable slots are victims; an in-place
//   refresh of a pinned, claimed or protected occupant is refused. evict() and clear() remove
//   anything committed.
// - pin() refuses an entry that is claimed or has a claimed ancestor (a pending reservation
//   would evict it at confirm, breaking the pinned chain).
// - bytes_used - bytes_claimed + bytes_reserved <= capacity_bytes after every reserve.
// Every public method takes the table's mutex: safe to call from several threads.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace anchorcache {

constexpr size_t kKeyBytes = 16;

enum class Region { kThin, kThick };

struct SlotEntry {
  std::string key;
  int64_t depth = 0;
  std::optional<std::string> parent;
  int64_t nbytes = 0;
  bool pinned = false;
  int64_t hits = 0;
  int64_t last_use = 0;  // logical clock tick of the last touch: its own or a descendant's
};

struct SlotReservation {
  int64_t slot;
  std::vector<std::string> victims;
};

struct SlotListing {
  int64_t slot;
  SlotEntry entry;
  bool reserved;  // false: committed entry; true: pending reservation
};

struct SlotTableStats {
  int64_t num_slots, used_slots, reserved_slots, free_slots;
  int64_t bytes_used, bytes_reserved, bytes_capacity;
  int64_t hits, misses, stale_evictions, reservations, confirms, aborts, evictions;
};

class SlotTable {
 public:
  SlotTable(int64_t num_slots, int64_t capacity_bytes, int64_t slot_base, int64_t pinned_slots);

  std::optional<SlotReservation> reserve(const std::string& key, int64_t depth, int64_t nbytes,
                                         const std::optional<std::string>& parent,
                                         Region region, std::optional<int64_t> slot);
  std::vector<std::string> confirm(int64_t slot);
  void abort(int64_t slot);
  std::optional<int64_t> lookup(const std::string& key, int64_t depth);
  bool contains(const std::string& key, int64_t depth) const;
  bool pin(const std::string& key);
  bool unpin(const std::string& key);
  bool evict(const std::string& key);
  std::vector<std::string> clear();
  std::vector<SlotListing> entries() const;
  SlotTableStats stats() const;

 private:
  struct Victim {
    std::string key;
    int64_t slot;
  };
  struct Pending {
    SlotEntry entry;
    std::vector<Victim> victims;
  };
  struct Slot {
    std::optional<SlotEntry> committed;
    std::optional<int64_t> claimed_by;  // slot of the reservation that will evict `committed`
    std::optional<Pending> pending;
  };
  struct MapEntry {
    int64_t slot;
    int64_t depth;
  };

  bool in_thin(int64_t slot) const;
  std::optional<int64_t> valid_slot(const std::string& key) const;  // committed, not stale
  // Slots of the committed entry's ancestors, nearest first (the cycle-guarded parent walk).
  std::vector<int64_t> ancestors(int64_t slot) const;
  // A fresh tick for the committed entry at `slot`, then a fresher one for each ancestor.
  void touch(int64_t slot);
  // Per slot: 1 if it is an ancestor of a committed pinned entry (so never a victim).
  std::vector<char> protected_slots() const;
  bool evictable(int64_t slot, const std::vector<char>& is_protected) const;
  // Least recently used evictable slot of the region, skipping slots marked in `taken`.
  std::optional<int64_t> lru_victim(bool thin, const std::vector<char>& taken,
                                    const std::vector<char>& is_protected) const;
  void drop_committed(int64_t slot);
  void check_slot(int64_t slot) const;

  const int64_t num_slots_, capacity_bytes_, slot_base_, pinned_slots_;
  mutable std::mutex mu_;
  std::vector<Slot> slots_;
  std::unordered_map<std::string, MapEntry> index_;         // committed keys
  std::unordered_map<std::string, int64_t> pending_keys_;   // reserved keys -> slot
  int64_t clock_ = 0;
  int64_t bytes_used_ = 0, bytes_reserved_ = 0, bytes_claimed_ = 0;
  int64_t hits_ = 0, misses_ = 0, stale_evictions_ = 0, reservations_ = 0, confirms_ = 0,
          aborts_ = 0, evictions_ = 0;
};

}  // namespace anchorcache
