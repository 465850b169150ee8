// The diagnosis (see the header). For each group (a name and its members,
// as the records name them):
//   - only the newest group of that name and ranks counts (its numbers
//     start again at 0);
//   - each member's first unfinished collective there is its "pending" one;
//     the group is stuck when some member has one, at the lowest such number s;
//   - a member with a record of #s is "in" it (or finished it); one whose
//     records there end before s "never called" it and is wherever its
//     newest unfinished collective is (another group), or in none;
//   - the verdict names the minority: the ranks whose #s differs from most
//     ranks' (op, dtype, sizes), the ranks that never called #s when most
//     did (behind), or the ranks that are alone in #s (ahead).

#include "diagnosis.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>

namespace commgrad::trace {
namespace {

std::string rank_word(const std::vector<int>& ranks) {
  return ranks.size() == 1 ? "rank " + std::to_string(ranks[0]) : "ranks " + format_ranks(ranks);
}

std::string seconds(int64_t us) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f s", static_cast<double>(us) / 1e6);
  return buf;
}

// The newest unfinished collective of `dump` outside group `key`, or null.
const Entry* elsewhere(const Dump& dump, const std::string& key) {
  for (auto it = dump.entries.rbegin(); it != dump.entries.rend(); ++it) {
    if (!it->finished() && it->group_key() != key) return &*it;
  }
  return nullptr;
}

std::string where(const Dump& dump, const std::string& key) {
  const Entry* e = elsewhere(dump, key);
  if (e == nullptr) return "it is in no collective (computing, or stuck outside commgrad)";
  return "it is in " + e->describe() + " on group '" + e->group + "' (" + e->state + ")";
}

// One group's members as the records show them at its stuck collective.
struct Stuck {
  std::string key;
  std::string name;
  std::vector<int> members;
  uint64_t seq = 0;
  std::map<std::string, std::vector<int>> in;   // signature -> ranks with a record of #seq
  std::map<std::string, const Entry*> example;  // signature -> one such record
  std::vector<int> behind;                      // never called #seq
  std::vector<int> missing;                     // left no dump
  std::vector<int> lost;                        // the ring no longer holds #seq
};

// The group `key` with `members` when stuck, else nothing.
bool find_stuck(const std::string& key, const std::vector<int>& members, const std::map<int, const Dump*>& dumps,
                Stuck& out) {
  std::map<int, std::vector<const Entry*>> mine;
  bool stuck = false;
  uint64_t s = UINT64_MAX;
  for (const int r : members) {
    const auto it = dumps.find(r);
    if (it == dumps.end()) continue;
    auto& list = mine[r];
    for (const Entry& e : it->second->entries) {
      if (e.group_key() != key) continue;
      if (!list.empty() && e.seq <= list.back()->seq) list.clear();  // a new group of the same name and ranks
      list.push_back(&e);
    }
    for (const Entry* e : list) {
      if (!e->finished()) {
        stuck = true;
        s = std::min(s, e->seq);
      }
    }
  }
  if (!stuck) return false;
  out.key = key;
  out.members = members;
  out.seq = s;
  for (const int r : members) {
    if (dumps.count(r) == 0) {
      out.missing.push_back(r);
      continue;
    }
    const auto& list = mine[r];
    const auto at = std::find_if(list.begin(), list.end(), [&](const Entry* e) { return e->seq == s; });
    if (at != list.end()) {
      out.name = (*at)->group;
      out.in[(*at)->signature()].push_back(r);
      out.example.emplace((*at)->signature(), *at);
    } else if (list.empty() || list.back()->seq < s) {
      out.behind.push_back(r);
    } else {
      out.lost.push_back(r);
    }
  }
  if (out.name.empty()) out.name = key.substr(0, key.find(' '));
  return true;
}

// The lines that describe one stuck group.
void describe(const Stuck& g, const std::map<int, const Dump*>& dumps, std::vector<std::string>& lines) {
  lines.push_back("group '" + g.name + "' (ranks " + format_ranks(g.members) + ") is stuck at collective #" +
                  std::to_string(g.seq) + ":");
  for (const auto& [signature, ranks] : g.in) {
    const Entry* e = g.example.at(signature);
    int64_t waited = 0;
    for (const int r : ranks) {
      for (const Entry& x : dumps.at(r)->entries) {
        if (x.group_key() == g.key && x.seq == g.seq) waited = std::max(waited, dumps.at(r)->dumped_us - x.queued_us);
      }
    }
    lines.push_back("  " + rank_word(ranks) + (ranks.size() == 1 ? " is" : " are") + " in " + e->describe() + " (" +
                    e->state + ", " + seconds(waited) + " after it was issued)");
  }
  for (const int r : g.behind) {
    const Dump& d = *dumps.at(r);
    std::string last = "none";
    for (const Entry& x : d.entries) {
      if (x.group_key() == g.key) last = x.describe() + ", " + x.state;
    }
    lines.push_back("  rank " + std::to_string(r) + " never called #" + std::to_string(g.seq) +
                    " (its last there: " + last + "); " + where(d, g.key));
  }
  for (const int r : g.lost) {
    lines.push_back("  rank " + std::to_string(r) + ": its record of #" + std::to_string(g.seq) +
                    " was overwritten (raise COMMGRAD_TRACE_BUFFER_SIZE)");
  }
  for (const int r : g.missing) {
    lines.push_back("  rank " + std::to_string(r) + " left no dump (it exited or was killed before it wrote one)");
  }
}

// The verdict on one stuck group: the ranks that differ from most.
void judge(const Stuck& g, const std::map<int, const Dump*>& dumps, std::vector<std::string>& lines) {
  const std::string at = " on group '" + g.name + "'";
  std::vector<int> present;
  std::string majority;
  size_t most = 0;
  bool tie = false;
  for (const auto& [signature, ranks] : g.in) {
    present.insert(present.end(), ranks.begin(), ranks.end());
    if (ranks.size() > most) {
      most = ranks.size();
      majority = signature;
      tie = false;
    } else if (ranks.size() == most) {
      tie = true;
    }
  }
  std::sort(present.begin(), present.end());
  if (g.in.size() > 1) {
    const std::string usual = g.example.at(majority)->describe();
    for (const auto& [signature, ranks] : g.in) {
      if (signature == majority && !tie) continue;
      lines.push_back(
          "  " + rank_word(ranks) + " called " + g.example.at(signature)->describe() + at +
          (tie ? " (the ranks disagree, no majority)" : " where " + rank_word(g.in.at(majority)) + " call " + usual));
    }
  }
  if (g.behind.empty() || g.in.empty()) return;
  const std::string what = g.example.at(majority)->describe();
  if (g.behind.size() < present.size()) {
    for (const int r : g.behind) {
      lines.push_back("  rank " + std::to_string(r) + " is behind" + at + ": " + rank_word(present) + " wait in " +
                      what + ", which rank " + std::to_string(r) + " never called; " + where(*dumps.at(r), g.key));
    }
  } else {
    lines.push_back("  " + rank_word(present) + " went ahead into " + what + at + ", which " + rank_word(g.behind) +
                    " never reached");
  }
}

}  // namespace

std::vector<std::string> diagnose(const std::vector<Dump>& dumps) {
  std::vector<std::string> lines;
  std::map<int, const Dump*> by_rank;
  std::vector<int> ranks;
  std::map<std::string, std::vector<int>> groups;  // key -> members
  for (const Dump& d : dumps) {
    by_rank[d.rank] = &d;
    ranks.push_back(d.rank);
    for (const Entry& e : d.entries) {
      if (!e.ranks.empty()) groups.emplace(e.group_key(), e.ranks);
    }
  }
  lines.push_back("flight records of " + rank_word(ranks));
  std::vector<Stuck> stuck;
  for (const auto& [key, members] : groups) {
    Stuck g;
    if (find_stuck(key, members, by_rank, g)) stuck.push_back(std::move(g));
  }
  if (stuck.empty()) {
    lines.push_back("no collective is stuck: every recorded collective finished on every rank that left a record");
    return lines;
  }
  for (const Stuck& g : stuck) describe(g, by_rank, lines);
  lines.push_back("diagnosis:");
  const size_t before = lines.size();
  for (const Stuck& g : stuck) judge(g, by_rank, lines);
  if (lines.size() == before) lines.push_back("  every rank is in the same collective: none differs from the others");
  return lines;
}

}  // namespace commgrad::trace
