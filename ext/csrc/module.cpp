// The Python module anchorcache.ext._C: loading it registers the TORCH_LIBRARY operators
// (schema.cpp, cpu_ops.cpp, ext/cuda/*.cu) and binds the slot table. The GIL is released
// around every table call; the table's own mutex makes it thread-safe.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "slot_table.h"

namespace py = pybind11;
using anchorcache::Region;
using anchorcache::SlotTable;

namespace {

py::object opt_bytes(const std::optional<std::string>& s) {
  return s ? py::object(py::bytes(*s)) : py::object(py::none());
}

py::list bytes_list(const std::vector<std::string>& keys) {
  py::list out;
  for (const std::string& k : keys) out.append(py::bytes(k));
  return out;
}

Region parse_region(const std::string& region) {
  if (region == "thin") return Region::kThin;
  if (region == "thick") return Region::kThick;
  throw std::invalid_argument("anchorcache: region must be 'thin' or 'thick', got '" + region +
                              "'");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("with_cuda") =
#ifdef ANCHORCACHE_WITH_CUDA
      true;
#else
      false;
#endif
  py::class_<SlotTable>(m, "SlotTable")
      .def(py::init<int64_t, int64_t, int64_t, int64_t>(), py::arg("num_slots"),
           py::arg("capacity_bytes"), py::arg("slot_base"), py::arg("pinned_slots"))
      .def(
          "reserve",
          [](SlotTable& t, const std::string& key, int64_t depth, int64_t nbytes,
             const std::optional<std::string>& parent, const std::string& region,
             std::optional<int64_t> slot) -> py::object {
            const Region r = parse_region(region);
            std::optional<anchorcache::SlotReservation> res;
            {
              py::gil_scoped_release release;
              res = t.reserve(key, depth, nbytes, parent, r, slot);
            }
            if (!res) return py::none();
            return py::make_tuple(res->slot, py::tuple(bytes_list(res->victims)));
          },
          py::arg("key"), py::arg("depth"), py::arg("nbytes"), py::arg("parent"),
          py::arg("region"), py::arg("slot"))
      .def("confirm",
           [](SlotTable& t, int64_t slot) {
             std::vector<std::string> evicted;
             {
               py::gil_scoped_release release;
               evicted = t.confirm(slot);
             }
             return bytes_list(evicted);
           })
      .def("abort", &SlotTable::abort, py::call_guard<py::gil_scoped_release>())
      .def("lookup", &SlotTable::lookup, py::call_guard<py::gil_scoped_release>())
      .def("contains", &SlotTable::contains, py::call_guard<py::gil_scoped_release>())
      .def("pin", &SlotTable::pin, py::call_guard<py::gil_scoped_release>())
      .def("unpin", &SlotTable::unpin, py::call_guard<py::gil_scoped_release>())
      .def("evict", &SlotTable::evict, py::call_guard<py::gil_scoped_release>())
      .def("clear",
           [](SlotTable& t) {
             std::vector<std::string> evicted;
             {
               py::gil_scoped_release release;
               evicted = t.clear();
             }
             return bytes_list(evicted);
           })
      .def("entries",
           [](const SlotTable& t) {
             std::vector<anchorcache::SlotListing> rows;
             {
               py::gil_scoped_release release;
               rows = t.entries();
             }
             py::list out;
             for (const auto& r : rows) {
               const auto& e = r.entry;
               out.append(py::make_tuple(r.slot, py::bytes(e.key), e.depth, opt_bytes(e.parent),
                                         e.nbytes, e.pinned, e.hits, e.last_use,
                                         r.reserved ? "reserved" : "committed"));
             }
             return out;
           })
      .def("stats", [](const SlotTable& t) {
        anchorcache::SlotTableStats s;
        {
          py::gil_scoped_release release;
          s = t.stats();
        }
        py::dict d;
        d["num_slots"] = s.num_slots;
        d["used_slots"] = s.used_slots;
        d["reserved_slots"] = s.reserved_slots;
        d["free_slots"] = s.free_slots;
        d["bytes_used"] = s.bytes_used;
        d["bytes_reserved"] = s.bytes_reserved;
        d["bytes_capacity"] = s.bytes_capacity;
        d["hits"] = s.hits;
        d["misses"] = s.misses;
        d["stale_evictions"] = s.stale_evictions;
        d["reservations"] = s.reservations;
        d["confirms"] = s.confirms;
        d["aborts"] = s.aborts;
        d["evictions"] = s.evictions;
        return d;
      });
}
