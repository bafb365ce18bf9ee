// The topology report (topology.h): /sys parsing, each rank's place, and rank 0's summary.
#include "dist/topology.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sched.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>

#include "qtrain/comm.h"
#include "runtime/process.h"

namespace qt {

namespace {

// Leading and trailing blanks (the kernel ends its files with a newline) dropped.
std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return {};
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

std::string read_file(const std::filesystem::path& p, bool* ok) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  *ok = static_cast<bool>(in);
  return ss.str();
}

int to_int(const std::string& s) {
  int v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || s.empty())
    throw std::invalid_argument(fmt::format("'{}' is not an integer", s));
  return v;
}

// Fields of a place travel as one line of tab-separated text: no tab or newline inside a field.
std::string field(std::string s) {
  std::replace_if(s.begin(), s.end(), [](char c) { return c == '\t' || c == '\n'; }, ' ');
  return s;
}

std::string serialize(const RankPlace& p) {
  return fmt::format("{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}", field(p.host), p.local_rank,
                     format_int_list(p.cpu_numa), p.gpu, p.gpu_numa, p.host_gpus,
                     field(p.gpu_name), field(p.gpu_links), field(p.gpu_error));
}

RankPlace deserialize(const std::string& line) {
  std::vector<std::string> f;
  std::size_t at = 0;
  for (;;) {
    const std::size_t tab = line.find('\t', at);
    f.push_back(line.substr(at, tab == std::string::npos ? std::string::npos : tab - at));
    if (tab == std::string::npos) break;
    at = tab + 1;
  }
  if (f.size() != 9) throw std::invalid_argument("a rank's place has " + std::to_string(f.size()) + " fields");
  RankPlace p;
  p.host = f[0];
  p.local_rank = to_int(f[1]);
  p.cpu_numa = parse_cpu_list(f[2]);
  p.gpu = to_int(f[3]);
  p.gpu_numa = to_int(f[4]);
  p.host_gpus = to_int(f[5]);
  p.gpu_name = f[6];
  p.gpu_links = f[7];
  p.gpu_error = f[8];
  return p;
}

// "n01, n02, n03" or "n01, n02, ... and 29 more".
std::string host_names(const std::vector<std::string>& names) {
  constexpr std::size_t kShown = 6;
  if (names.size() <= kShown) return fmt::format("{}", fmt::join(names, ", "));
  std::vector<std::string> first(names.begin(), names.begin() + kShown);
  return fmt::format("{} and {} more", fmt::join(first, ", "), names.size() - kShown);
}

const char* link_name(GpuLink k) {
  switch (k) {
    case GpuLink::kNvLink: return "NVLink";
    case GpuLink::kPcie: return "PCIe";
    case GpuLink::kPeer: return "peer access (link unknown)";
    case GpuLink::kNoPeer: return "no peer access (copies through host memory)";
    case GpuLink::kUnknown: break;
  }
  return "unknown links";
}

// The body of one host's entry: what follows "hosts a, b: " and the lines of its ranks (the
// host's places in local rank order). Hosts with equal bodies share an entry.
std::vector<std::string> host_body(const std::vector<const RankPlace*>& ranks) {
  std::vector<std::string> out;
  const RankPlace* first = ranks.front();
  for (const RankPlace* p : ranks)
    if (p->local_rank == 0) first = p;
  std::string head = fmt::format("{} rank{}", ranks.size(), ranks.size() == 1 ? "" : "s");
  if (first->host_gpus > 0) {
    head += fmt::format(", {} GPU{} ({}), {}", first->host_gpus, first->host_gpus == 1 ? "" : "s",
                        first->gpu_name, first->gpu_links);
  } else if (first->host_gpus == 0) {
    head += fmt::format(", no GPU ({})", first->gpu_error);
  } else if (!first->gpu_error.empty()) {
    head += fmt::format(", GPUs unknown ({})", first->gpu_error);
  }
  out.push_back(head);
  // Consecutive local ranks with the same CPU and GPU NUMA nodes form one line.
  std::vector<std::string> misplaced;
  for (std::size_t a = 0; a < ranks.size();) {
    std::size_t b = a + 1;
    while (b < ranks.size() && ranks[b]->cpu_numa == ranks[a]->cpu_numa &&
           ranks[b]->gpu_numa == ranks[a]->gpu_numa && (ranks[b]->gpu < 0) == (ranks[a]->gpu < 0))
      ++b;
    std::vector<int> locals, gpus;
    for (std::size_t i = a; i < b; ++i) {
      locals.push_back(ranks[i]->local_rank);
      if (ranks[i]->gpu >= 0) gpus.push_back(ranks[i]->gpu);
    }
    std::sort(gpus.begin(), gpus.end());
    gpus.erase(std::unique(gpus.begin(), gpus.end()), gpus.end());
    const RankPlace& p = *ranks[a];
    const std::string who = fmt::format("local rank{} {}", locals.size() == 1 ? "" : "s",
                                        format_int_list(locals));
    std::string line = who + ": CPUs " +
        (p.cpu_numa.empty() ? std::string("(NUMA unknown)") : "on NUMA " + format_int_list(p.cpu_numa));
    if (!gpus.empty())
      line += fmt::format(", GPU{} {} {}", gpus.size() == 1 ? "" : "s", format_int_list(gpus),
                          p.gpu_numa >= 0 ? fmt::format("on NUMA {}", p.gpu_numa) : "(NUMA unknown)");
    out.push_back(line);
    const std::vector<int> own = {p.gpu_numa};
    if (p.gpu_numa >= 0 && !p.cpu_numa.empty() && p.cpu_numa != own)
      misplaced.push_back(fmt::format("{} may run on CPUs of NUMA {}, their GPU{} on NUMA {}", who,
                                      format_int_list(p.cpu_numa), gpus.size() == 1 ? " is" : "s are",
                                      p.gpu_numa));
    a = b;
  }
  if (!misplaced.empty())
    out.push_back(fmt::format("warning: {}: bind each rank to its GPU's NUMA node (srun "
                              "--cpu-bind=map_ldom:..., mpirun --map-by ppr:N:numa --bind-to numa; "
                              "docs/cluster.md)", fmt::join(misplaced, "; ")));
  return out;
}

}  // namespace

std::vector<int> parse_cpu_list(const std::string& text) {
  std::vector<int> out;
  const std::string t = trim(text);
  if (t.empty()) return out;
  std::size_t at = 0;
  while (at <= t.size()) {
    const std::size_t comma = std::min(t.find(',', at), t.size());
    const std::string item = t.substr(at, comma - at);
    const std::size_t dash = item.find('-');
    const int lo = to_int(dash == std::string::npos ? item : item.substr(0, dash));
    const int hi = dash == std::string::npos ? lo : to_int(item.substr(dash + 1));
    if (lo < 0 || hi < lo) throw std::invalid_argument(fmt::format("bad range '{}'", item));
    for (int c = lo; c <= hi; ++c) out.push_back(c);
    at = comma + 1;
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::string format_int_list(const std::vector<int>& v) {
  std::string out;
  for (std::size_t a = 0; a < v.size();) {
    std::size_t b = a;
    while (b + 1 < v.size() && v[b + 1] == v[b] + 1) ++b;
    if (!out.empty()) out += ',';
    out += b == a ? std::to_string(v[a]) : fmt::format("{}-{}", v[a], v[b]);
    a = b + 1;
  }
  return out;
}

std::vector<int> numa_nodes_of_cpus(const std::string& root, const std::vector<int>& cpus) {
  std::vector<int> nodes;
  std::error_code ec;
  const std::filesystem::path dir = root + "/sys/devices/system/node";
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() < 5 || name.compare(0, 4, "node") != 0 ||
        !std::all_of(name.begin() + 4, name.end(), [](unsigned char c) { return std::isdigit(c); }))
      continue;
    bool ok = false;
    const std::string text = read_file(e.path() / "cpulist", &ok);
    if (!ok) continue;
    try {
      const std::vector<int> on = parse_cpu_list(text);
      if (std::any_of(cpus.begin(), cpus.end(),
                      [&](int c) { return std::binary_search(on.begin(), on.end(), c); }))
        nodes.push_back(to_int(name.substr(4)));
    } catch (const std::invalid_argument&) {
      // An unreadable list says nothing about this node.
    }
  }
  std::sort(nodes.begin(), nodes.end());
  return nodes;
}

int pci_numa_node(const std::string& root, const std::string& bus_id) {
  // sysfs names a device "dddd:bb:dd.f" in lower case; NVML writes an 8-digit domain.
  std::string id = trim(bus_id);
  std::transform(id.begin(), id.end(), id.begin(), [](unsigned char c) { return std::tolower(c); });
  const std::size_t colon = id.find(':');
  if (colon == std::string::npos) return -1;
  if (colon > 4) id = id.substr(colon - 4);
  bool ok = false;
  const std::string text = read_file(root + "/sys/bus/pci/devices/" + id + "/numa_node", &ok);
  if (!ok) return -1;
  try {
    return std::max(to_int(trim(text)), -1);
  } catch (const std::invalid_argument&) {
    return -1;
  }
}

std::vector<int> allowed_cpus() {
  std::vector<int> out;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return out;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) out.push_back(c);
  return out;
}

std::string gpu_links_text(int n, const std::vector<GpuLink>& kind, const std::vector<int>& nvlinks) {
  if (n <= 0) return "no GPU";
  if (n == 1) return "one GPU";
  const int pairs = n * (n - 1) / 2;
  std::map<GpuLink, std::vector<std::string>> by_kind;  // the pairs "i-j" of each kind
  for (int i = 0; i < n; ++i)
    for (int j = i + 1; j < n; ++j)
      by_kind[kind[static_cast<std::size_t>(i) * n + j]].push_back(fmt::format("{}-{}", i, j));
  std::string links;
  if (!nvlinks.empty() && by_kind.count(GpuLink::kNvLink)) {
    const auto [lo, hi] = std::minmax_element(nvlinks.begin(), nvlinks.end());
    links = *lo == *hi ? fmt::format(" ({} links each)", *lo) : fmt::format(" ({}-{} links each)", *lo, *hi);
  }
  if (by_kind.size() == 1) {
    const GpuLink k = by_kind.begin()->first;
    if (k == GpuLink::kUnknown) return "links unknown";
    if (k == GpuLink::kNoPeer) return fmt::format("no peer access between the {} GPUs (copies through host memory)", n);
    return fmt::format("{} between all {} GPUs{}{}", link_name(k), n,
                       k == GpuLink::kNvLink ? links : "", k == GpuLink::kPcie ? " (no NVLink)" : "");
  }
  std::vector<std::string> parts;
  for (const auto& [k, list] : by_kind) {
    constexpr std::size_t kShown = 6;
    std::vector<std::string> shown(list.begin(), list.begin() + std::min(list.size(), kShown));
    parts.push_back(fmt::format("{} between {} of {} pairs ({}{}){}", link_name(k), list.size(), pairs,
                                fmt::join(shown, ", "), list.size() > kShown ? ", ..." : "",
                                k == GpuLink::kNvLink ? links : ""));
  }
  return fmt::format("{}", fmt::join(parts, "; "));
}

#ifndef QTRAIN_HAVE_CUDA
LocalGpus query_local_gpus(bool) {
  LocalGpus g;
  g.error = "this qtrain was built without CUDA";
  return g;
}
#endif

RankPlace local_place(const std::string& host, int local_rank, bool gpus) {
  RankPlace p;
  p.host = host;
  p.local_rank = local_rank;
  p.cpu_numa = numa_nodes_of_cpus("", allowed_cpus());
  if (!gpus) return p;
  const bool first = local_rank == 0;
  const LocalGpus g = query_local_gpus(first);
  if (g.count > 0) {
    p.gpu = local_rank % g.count;  // as cuda::select_device picks it
    p.gpu_numa = pci_numa_node("", g.bus_ids[static_cast<std::size_t>(p.gpu)]);
  }
  if (first) {
    p.host_gpus = g.count;
    p.gpu_name = g.name;
    p.gpu_links = g.links;
    p.gpu_error = g.error;
  }
  return p;
}

std::string topology_summary(const std::vector<RankPlace>& places) {
  // Hosts in order of their first rank, each with its places by local rank.
  std::vector<std::string> hosts;
  std::map<std::string, std::vector<const RankPlace*>> of_host;
  for (const RankPlace& p : places) {
    if (!of_host.count(p.host)) hosts.push_back(p.host);
    of_host[p.host].push_back(&p);
  }
  std::vector<std::vector<std::string>> bodies;  // distinct bodies in order of first host
  std::vector<std::vector<std::string>> names;   // the hosts of each body
  for (const std::string& h : hosts) {
    std::vector<const RankPlace*>& r = of_host[h];
    std::stable_sort(r.begin(), r.end(),
                     [](const RankPlace* a, const RankPlace* b) { return a->local_rank < b->local_rank; });
    const std::vector<std::string> body = host_body(r);
    const auto it = std::find(bodies.begin(), bodies.end(), body);
    if (it == bodies.end()) {
      bodies.push_back(body);
      names.push_back({h});
    } else {
      names[it - bodies.begin()].push_back(h);
    }
  }
  std::string out = fmt::format("topology: {} host{}, {} rank{}\n", hosts.size(),
                                hosts.size() == 1 ? "" : "s", places.size(), places.size() == 1 ? "" : "s");
  for (std::size_t b = 0; b < bodies.size(); ++b) {
    out += fmt::format("  host{} {}: {}\n", names[b].size() == 1 ? "" : "s", host_names(names[b]),
                       bodies[b][0]);
    for (std::size_t i = 1; i < bodies[b].size(); ++i) out += "    " + bodies[b][i] + "\n";
  }
  return out;
}

std::string topology_report(MpiComm& world, int local_rank, bool gpus) {
  const std::vector<std::string> all =
      gather_strings(serialize(local_place(host_name(), local_rank, gpus)), world);
  if (world.rank() != 0) return {};
  std::vector<RankPlace> places;
  for (const std::string& s : all) places.push_back(deserialize(s));
  return topology_summary(places);
}

}  // namespace qt
