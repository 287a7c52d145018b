// The wording of the failures both languages report: the templates live in
// gluon_syncbn/messages.py, handed over when the library loads
// (gsbn_init), before any operator runs; `message` fills in their
// "{field}"s as messages.text does, so a message reads the same whichever
// backend raised it. Included once, by syncbn.cc.
#pragma once

#include <cstdio>
#include <initializer_list>
#include <map>
#include <string>
#include <utility>

namespace {

using Fields = std::initializer_list<std::pair<const char*, std::string>>;

// Written only while the library loads; read-only once operators run. Never
// destroyed, like the session's state: the watchdog and a fatal failure's
// exit thread may word a message while the process exits.
std::map<std::string, std::string>& message_templates() {
  static auto& templates = *new std::map<std::string, std::string>();
  return templates;
}

std::string message(const char* name, Fields fields) {
  auto it = message_templates().find(name);
  if (it == message_templates().end()) {  // the templates never came (gsbn_init)
    std::string out = std::string("SyncBatchNorm: ") + name;
    for (const auto& f : fields) out += std::string(", ") + f.first + "=" + f.second;
    return out;
  }
  const std::string& t = it->second;
  std::string out;
  for (size_t i = 0; i < t.size(); ++i) {
    const size_t end = t[i] == '{' ? t.find('}', i) : std::string::npos;
    const std::pair<const char*, std::string>* field = nullptr;
    if (end != std::string::npos)
      for (const auto& f : fields)
        if (t.compare(i + 1, end - i - 1, f.first) == 0) field = &f;
    if (field != nullptr) {
      out += field->second;
      i = end;
    } else {
      out += t[i];
    }
  }
  return out;
}

// A number as C's %g formats it.
std::string number(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", value);
  return text;
}

}  // namespace
