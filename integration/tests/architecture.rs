//! The house rules of `src/`, checked: each top-level room uses only the rooms below it (so no circle between
//! rooms can come back), and the health engine stays pure (no tokio, no file system, no output). The harness
//! crates (the fake kubelet, the fake NVML library, the bench) keep the same one-way rule between their
//! modules: no circle of `crate::` and `super::` uses.
//!
//! Read from the sources themselves: every `crate::<room>` path outside comments and test code counts.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The rooms of `src/`, lowest first: a room may use only the rooms before it. The data flows up this list:
/// sources → device model → health engine → monitor → outputs, with operator inputs and configuration on top.
const ROOMS: &[&str] = &[
    "util", // text, threads and runtimes, the open-file limit, bounded sockets, Unix-socket channels
    "api",  // the kubelet's wire types, generated from proto/
    "devices", // the device model: inventory, MIG, naming, resources, sharing, allocation
    "health", // the pure engine: policy, XID catalog, messages, the checkpoint's record
    "sources", // where devices and events come from: NVML, simulated GPUs, the fault script
    "metrics", // the Prometheus metrics, recorded by the rooms above
    "monitor", // the task around the engine: inventory, checkpoint file, operator requests
    "kubelet", // the device plugin server, registration, the socket watch, pod-resources
    "cluster", // the Kubernetes API: Events, the node condition
    "dra",  // serving GPUs through DRA: registration, prepare and its record, the health stream
    "http", // /healthz, /readyz, /status, /metrics and the status report
    "fence", // operator inputs: the control socket, the fence directory, the Node annotation
    "config", // flags, environment, our config file and NVIDIA's
    "roads", // which GPU on which road, each resource's registration, a change of roads checked
    "reload", // a SIGHUP's reload: the roads' change checked, the GPUs watched across the restart
    "commands", // the binary's commands: status, fence, release, check-config, the reload's own
];

/// What the health engine may use, of the rooms below it.
const HEALTH_USES: &[&str] = &["util", "devices"];

/// Paths the health engine must never name: it is pure (events and time in, conditions out).
const HEALTH_NEVER: &[&str] = &[
    "tokio",
    "std::fs",
    "std::net",
    "std::thread",
    "std::process",
    "std::io",
    "tempfile",
    "File::",
];

/// A use of one room by another, where it is.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Use {
    room: String,
    line: usize,
}

/// The production code of a source file: test code (from the first `#[cfg(test)]`) and comments removed,
/// each kept line with its number.
fn production_lines(text: &str) -> Vec<(usize, &str)> {
    let mut kept = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("#[cfg(test)]") {
            break;
        }
        if trimmed.starts_with("//") {
            continue;
        }
        // A trailing comment is not code either.
        let code = line.split_once("//").map_or(line, |(code, _)| code);
        kept.push((i + 1, code));
    }
    kept
}

/// Every room `text` names through `crate::`, with `use crate::{a, b::c}` groups taken apart.
fn rooms_used(text: &str) -> Vec<Use> {
    let mut uses = Vec::new();
    for (line, code) in production_lines(text) {
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                let inner = group.split('}').next().unwrap_or_default();
                for part in inner.split(',') {
                    let room: String = part
                        .trim()
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    if !room.is_empty() {
                        uses.push(Use { room, line });
                    }
                }
            } else {
                let room: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !room.is_empty() {
                    uses.push(Use { room, line });
                }
            }
        }
    }
    uses
}

/// What is wrong with one file of `room`, in words naming the file and line.
fn violations(room: &str, file: &str, text: &str) -> Vec<String> {
    let mut wrong = Vec::new();
    let Some(rank) = ROOMS.iter().position(|r| *r == room) else {
        return vec![format!(
            "{file}: room {room} is not in ROOMS: give it its place in the order"
        )];
    };
    let below = &ROOMS[..rank];
    for used in rooms_used(text) {
        if used.room == room {
            continue;
        }
        let allowed = if room == "health" {
            HEALTH_USES.contains(&used.room.as_str())
        } else {
            below.contains(&used.room.as_str())
        };
        if !allowed {
            let may = if room == "health" { HEALTH_USES } else { below };
            wrong.push(format!(
                "{file}:{}: {room} uses crate::{}, but may use only: {}",
                used.line,
                used.room,
                may.join(", ")
            ));
        }
    }
    if room == "health" {
        for (line, code) in production_lines(text) {
            for never in HEALTH_NEVER {
                if code.contains(never) {
                    wrong.push(format!(
                        "{file}:{line}: the health engine is pure, but names {never}"
                    ));
                }
            }
        }
    }
    wrong
}

/// Every `.rs` file under `dir`, test-only files (`tests.rs`, `tests/`) left out.
fn sources(dir: &Path, into: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if path.is_dir() {
            if name != "tests" {
                sources(&path, into)?;
            }
        } else if name.ends_with(".rs") && name != "tests.rs" {
            into.push(path);
        }
    }
    Ok(())
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn every_room_uses_only_the_rooms_below_it_and_health_stays_pure() -> std::io::Result<()> {
    let src = src();
    let mut files = Vec::new();
    sources(&src, &mut files)?;
    let mut wrong = Vec::new();
    let mut checked = 0;
    for path in files {
        let relative = path.strip_prefix(&src).unwrap_or(&path);
        let first = relative
            .components()
            .next()
            .and_then(|c| c.as_os_str().to_str())
            .unwrap_or_default();
        let room = first.trim_end_matches(".rs");
        if matches!(room, "lib" | "main") {
            continue;
        }
        let text = std::fs::read_to_string(&path)?;
        wrong.extend(violations(room, &relative.display().to_string(), &text));
        checked += 1;
    }
    assert!(
        checked > 20,
        "only {checked} files found under {}",
        src.display()
    );
    assert!(wrong.is_empty(), "\n{}", wrong.join("\n"));
    Ok(())
}

#[test]
fn the_rooms_are_the_modules_lib_rs_declares() -> std::io::Result<()> {
    let lib = std::fs::read_to_string(src().join("lib.rs"))?;
    let declared: BTreeSet<&str> = lib
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub mod "))
        .map(|m| m.trim_end_matches(';'))
        .collect();
    let listed: BTreeSet<&str> = ROOMS.iter().copied().collect();
    assert_eq!(declared, listed, "lib.rs and ROOMS disagree");
    Ok(())
}

#[test]
fn a_use_of_a_room_above_is_caught_and_comments_and_tests_are_not_uses() {
    let text = "\
//! Uses of [`crate::http`] in docs are not uses.
use crate::devices::Inventory;
use crate::{util::text, monitor::MonitorHandle};
fn f() { crate::kubelet::run(); } // crate::cluster in a comment
#[cfg(test)]
mod tests { use crate::config::Settings; }
";
    let wrong = violations("sources", "sources/x.rs", text);
    assert_eq!(
        wrong,
        [
            "sources/x.rs:3: sources uses crate::monitor, but may use only: util, api, devices, health",
            "sources/x.rs:4: sources uses crate::kubelet, but may use only: util, api, devices, health",
        ]
    );
    let impure = violations(
        "health",
        "health/x.rs",
        "use tokio::sync::mpsc;\nuse crate::metrics::Metrics;\n",
    );
    assert_eq!(
        impure,
        [
            "health/x.rs:2: health uses crate::metrics, but may use only: util, devices",
            "health/x.rs:1: the health engine is pure, but names tokio",
        ]
    );
}

// The harness crates: a graph of each crate's modules, drawn from their `crate::` and `super::` paths.

/// The harness crates, each a graph of its own from each of its roots (`src/lib.rs`, `src/main.rs`).
const HARNESSES: &[&str] = &[
    "integration/fake-kubelet",
    "integration/fake-nvml",
    "integration/bench",
];

/// `text` with its comments, string and character literals blanked (newlines kept, so line numbers hold), and
/// every item under `#[cfg(test)]` blanked too: what is left is the code that builds the crate.
fn code_of(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out: Vec<char> = Vec::with_capacity(chars.len());
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        let before = i.checked_sub(1).map(|b| chars[b]);
        let raw_hashes = (c == 'r'
            && (before.is_none_or(|b| !ident(b))
                || (before == Some('b') && (i < 2 || !ident(chars[i - 2])))))
        .then(|| chars[i + 1..].iter().take_while(|&&h| h == '#').count())
        .filter(|&n| chars.get(i + 1 + n) == Some(&'"'));
        let end = if c == '/' && next == Some('/') {
            chars[i..]
                .iter()
                .position(|&c| c == '\n')
                .map_or(chars.len(), |n| i + n)
        } else if c == '/' && next == Some('*') {
            let (mut j, mut depth) = (i, 0);
            while j < chars.len() {
                if chars[j] == '/' && chars.get(j + 1) == Some(&'*') {
                    depth += 1;
                    j += 2;
                } else if chars[j] == '*' && chars.get(j + 1) == Some(&'/') {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            j
        } else if let Some(hashes) = raw_hashes {
            let mut j = i + hashes + 2;
            while j < chars.len()
                && !(chars[j] == '"'
                    && chars[j + 1..]
                        .iter()
                        .take(hashes)
                        .filter(|&&h| h == '#')
                        .count()
                        == hashes)
            {
                j += 1;
            }
            (j + 1 + hashes).min(chars.len())
        } else if c == '"' {
            let mut j = i + 1;
            while j < chars.len() && chars[j] != '"' {
                j += if chars[j] == '\\' { 2 } else { 1 };
            }
            (j + 1).min(chars.len())
        } else if c == '\'' && next == Some('\\') {
            chars
                .get(i + 3..)
                .and_then(|rest| rest.iter().position(|&c| c == '\''))
                .map_or(chars.len(), |n| i + 4 + n)
        } else if c == '\'' && chars.get(i + 2) == Some(&'\'') {
            i + 3
        } else {
            out.push(if c.is_ascii() { c } else { ' ' });
            i += 1;
            continue;
        };
        out.extend(chars[i..end].iter().map(|&c| blank(c)));
        i = end;
    }
    // Test items: from the attribute to the `;` or the closing brace that ends the item.
    let marker: Vec<char> = "#[cfg(test)]".chars().collect();
    let mut at = 0;
    while at + marker.len() <= out.len() {
        if out[at..at + marker.len()] != marker[..] {
            at += 1;
            continue;
        }
        let (mut j, mut depth) = (at + marker.len(), 0);
        while j < out.len() {
            match out[j] {
                ';' if depth == 0 => break,
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        break;
                    }
                }
                _ => {}
            }
            j += 1;
        }
        let end = (j + 1).min(out.len());
        for c in &mut out[at..end] {
            *c = blank(*c);
        }
        at = end;
    }
    out.into_iter().collect()
}

/// One module of a crate: its path (`dra::plugins`; the root is `crate`), its file, and its own code (what
/// its child modules hold blanked).
#[derive(Debug)]
struct Module {
    path: Vec<String>,
    file: PathBuf,
    code: String,
}

impl Module {
    fn name(&self) -> String {
        if self.path.is_empty() {
            "crate".to_string()
        } else {
            self.path.join("::")
        }
    }
}

/// The modules of the crate whose root is `root`, as its `mod` declarations reach them (test modules left
/// out); `read` gives a file's text, `None` where there is none.
fn modules(root: &Path, read: &dyn Fn(&Path) -> Option<String>) -> Result<Vec<Module>, String> {
    let text = read(root).ok_or_else(|| format!("{}: not found", root.display()))?;
    let dir = root.parent().unwrap_or(Path::new("")).to_path_buf();
    let mut found = Vec::new();
    declared(Vec::new(), root, code_of(&text), &dir, read, &mut found)?;
    Ok(found)
}

/// Takes in the module `path` of `file` whose code is `code`, and every module it declares; `dir` is where
/// its child modules' files are.
fn declared(
    path: Vec<String>,
    file: &Path,
    mut code: String,
    dir: &Path,
    read: &dyn Fn(&Path) -> Option<String>,
    found: &mut Vec<Module>,
) -> Result<(), String> {
    let bytes = code.as_bytes().to_vec();
    let word = |at: usize| {
        bytes[at..]
            .iter()
            .take_while(|b| b.is_ascii_alphanumeric() || **b == b'_')
            .count()
    };
    let space = |at: usize| {
        bytes[at..]
            .iter()
            .take_while(|b| b.is_ascii_whitespace())
            .count()
    };
    let mut inline = Vec::new();
    let (mut at, mut depth) = (0, 0);
    while at < bytes.len() {
        let starts_word =
            at == 0 || !(bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_');
        match bytes[at] {
            b'{' => depth += 1,
            b'}' => depth -= 1,
            b'm' if depth == 0 && starts_word && word(at) == 3 && &bytes[at..at + 3] == b"mod" => {
                let name_at = at + 3 + space(at + 3);
                let name = &code[name_at..name_at + word(name_at)];
                let after = name_at + name.len();
                let after = after + space(after);
                let mut child = path.clone();
                child.push(name.to_string());
                match bytes.get(after) {
                    Some(b';') => {
                        let file = [
                            dir.join(format!("{name}.rs")),
                            dir.join(name).join("mod.rs"),
                        ]
                        .into_iter()
                        .find(|f| read(f).is_some())
                        .ok_or_else(|| format!("{}: mod {name}: no file for it", file.display()))?;
                        let text = read(&file).unwrap_or_default();
                        let stem = file
                            .file_stem()
                            .and_then(|s| s.to_str())
                            .unwrap_or_default();
                        let dir = if stem == "mod" {
                            dir.join(name)
                        } else {
                            file.with_extension("")
                        };
                        declared(child, &file, code_of(&text), &dir, read, found)?;
                    }
                    Some(b'{') => {
                        let mut end = after;
                        let mut inner = 0;
                        for (j, b) in bytes.iter().enumerate().skip(after) {
                            match b {
                                b'{' => inner += 1,
                                b'}' => inner -= 1,
                                _ => {}
                            }
                            if inner == 0 {
                                end = j;
                                break;
                            }
                        }
                        inline.push((child, after + 1, end));
                        at = end;
                    }
                    _ => {}
                }
            }
            _ => {}
        }
        at += 1;
    }
    // An inline module's code: its body, everything else blanked (so its line numbers are the file's).
    for (child, start, end) in inline {
        let body: String = code
            .char_indices()
            .map(|(i, c)| {
                if (start..end).contains(&i) || c == '\n' {
                    c
                } else {
                    ' '
                }
            })
            .collect();
        let blanked: String = code[start..end]
            .chars()
            .map(|c| if c == '\n' { c } else { ' ' })
            .collect();
        code.replace_range(start..end, &blanked);
        let name = child.last().cloned().unwrap_or_default();
        declared(child, file, body, &dir.join(name), read, found)?;
    }
    found.push(Module {
        path,
        file: file.to_path_buf(),
        code,
    });
    Ok(())
}

/// Every path in `code` that starts with `crate::` or `super::` (`use` groups taken apart), with its line:
/// `super` and `self` kept as they are written, for [`resolve`].
fn module_paths(code: &str) -> Vec<(Vec<String>, usize)> {
    // Tokens: words, `::`, and single punctuation, each with its line.
    let mut tokens: Vec<(String, usize)> = Vec::new();
    let bytes = code.as_bytes();
    let (mut at, mut line) = (0, 1);
    while at < bytes.len() {
        let b = bytes[at];
        if b == b'\n' {
            line += 1;
            at += 1;
        } else if b.is_ascii_whitespace() {
            at += 1;
        } else if b.is_ascii_alphanumeric() || b == b'_' {
            let len = bytes[at..]
                .iter()
                .take_while(|b| b.is_ascii_alphanumeric() || **b == b'_')
                .count();
            tokens.push((code[at..at + len].to_string(), line));
            at += len;
        } else if code[at..].starts_with("::") {
            tokens.push(("::".to_string(), line));
            at += 2;
        } else {
            tokens.push(((b as char).to_string(), line));
            at += 1;
        }
    }
    fn tree(
        tokens: &[(String, usize)],
        at: &mut usize,
        prefix: &[String],
        line: usize,
        out: &mut Vec<(Vec<String>, usize)>,
    ) {
        match tokens.get(*at).map(|(t, _)| t.as_str()) {
            Some("{") => {
                *at += 1;
                while let Some((t, _)) = tokens.get(*at) {
                    match t.as_str() {
                        "}" => break,
                        "," => *at += 1,
                        _ => {
                            let before = *at;
                            tree(tokens, at, prefix, line, out);
                            if *at == before {
                                *at += 1;
                            }
                        }
                    }
                }
                *at += 1;
            }
            Some(word) if word.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') => {
                let mut path = prefix.to_vec();
                path.push(word.to_string());
                *at += 1;
                if tokens.get(*at).is_some_and(|(t, _)| t == "::") {
                    *at += 1;
                    tree(tokens, at, &path, line, out);
                } else {
                    out.push((path, line));
                }
            }
            _ => out.push((prefix.to_vec(), line)),
        }
    }
    let mut paths = Vec::new();
    for i in 0..tokens.len() {
        let (word, line) = &tokens[i];
        let starts = (word == "crate" || word == "super")
            && tokens.get(i + 1).is_some_and(|(t, _)| t == "::")
            && (i == 0 || tokens[i - 1].0 != "::");
        if starts {
            let mut at = i;
            tree(&tokens, &mut at, &[], *line, &mut paths);
        }
    }
    paths
}

/// The module `path`, written in module `from`, names: the deepest module of `known` it reaches.
fn resolve(from: &[String], path: &[String], known: &BTreeSet<Vec<String>>) -> Vec<String> {
    let mut at: Vec<String> = Vec::new();
    let mut segments = path.iter().peekable();
    if segments.peek().is_some_and(|s| *s == "crate") {
        segments.next();
    } else {
        at = from.to_vec();
        while segments.peek().is_some_and(|s| *s == "super") {
            segments.next();
            at.pop();
        }
    }
    for segment in segments {
        let mut next = at.clone();
        next.push(segment.clone());
        if !known.contains(&next) {
            break;
        }
        at = next;
    }
    at
}

/// The uses between modules: from each module, the modules it names, each with the file and line of its first
/// use.
type Graph = BTreeMap<String, BTreeMap<String, String>>;

fn graph(modules: &[Module], base: &Path) -> Graph {
    let known: BTreeSet<Vec<String>> = modules.iter().map(|m| m.path.clone()).collect();
    let mut graph = Graph::new();
    for module in modules {
        let uses = graph.entry(module.name()).or_default();
        for (path, line) in module_paths(&module.code) {
            let to = resolve(&module.path, &path, &known);
            if to == module.path {
                continue;
            }
            let to = Module {
                path: to,
                file: PathBuf::new(),
                code: String::new(),
            }
            .name();
            let file = module.file.strip_prefix(base).unwrap_or(&module.file);
            uses.entry(to)
                .or_insert_with(|| format!("{}:{line}", file.display()));
        }
    }
    graph
}

/// A circle in `graph`, as the modules around it with the first one again at the end; `None` if there is none.
fn find_cycle(graph: &Graph) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &Graph,
        done: &mut BTreeSet<String>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        stack.push(node.to_string());
        for next in graph.get(node).into_iter().flat_map(|uses| uses.keys()) {
            if let Some(at) = stack.iter().position(|n| n == next) {
                let mut cycle = stack[at..].to_vec();
                cycle.push(next.clone());
                return Some(cycle);
            }
            if !done.contains(next)
                && let Some(cycle) = visit(next, graph, done, stack)
            {
                return Some(cycle);
            }
        }
        stack.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    for node in graph.keys() {
        if !done.contains(node)
            && let Some(cycle) = visit(node, graph, &mut done, &mut Vec::new())
        {
            return Some(cycle);
        }
    }
    None
}

/// A circle, in words: each step with where the use is.
fn describe(cycle: &[String], graph: &Graph) -> String {
    cycle
        .windows(2)
        .map(|step| {
            let at = graph
                .get(&step[0])
                .and_then(|uses| uses.get(&step[1]))
                .map_or("", String::as_str);
            format!("{} → {} ({at})", step[0], step[1])
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[test]
fn no_harness_crate_has_a_circle_between_its_modules() -> Result<(), String> {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"));
    let read = |path: &Path| std::fs::read_to_string(path).ok();
    let mut wrong = Vec::new();
    for harness in HARNESSES {
        let dir = workspace.join(harness);
        let mut roots = 0;
        for root in ["src/lib.rs", "src/main.rs"] {
            let root = dir.join(root);
            if !root.exists() {
                continue;
            }
            roots += 1;
            let modules = modules(&root, &read)?;
            let graph = graph(&modules, &dir);
            if let Some(cycle) = find_cycle(&graph) {
                wrong.push(format!(
                    "{harness}: a circle between modules: {}",
                    describe(&cycle, &graph)
                ));
            }
        }
        assert!(roots > 0, "{harness}: no src/lib.rs nor src/main.rs");
    }
    assert!(wrong.is_empty(), "\n{}", wrong.join("\n"));
    // The graphs are not empty: the harnesses' modules do use each other.
    let bench = modules(&workspace.join("integration/bench/src/main.rs"), &read)?;
    let uses = graph(&bench, workspace);
    assert!(
        uses.get("measure").is_some_and(|u| u.contains_key("abuse")),
        "{uses:?}"
    );
    Ok(())
}

#[test]
fn a_circle_between_modules_is_found_and_named() -> Result<(), String> {
    let files: BTreeMap<&str, &str> = BTreeMap::from([
        (
            "c/src/lib.rs",
            "mod a;\nmod b;\nmod c;\n#[cfg(test)]\nmod tests;\npub mod inline {\n    pub use super::c::Z;\n}\n",
        ),
        (
            "c/src/a.rs",
            "//! Not a use: crate::c.\nuse crate::b::X;\nconst S: &str = \"crate::c::Z\";\n",
        ),
        (
            "c/src/b/mod.rs",
            "mod deep;\nuse super::{\n    inline::{self},\n    lib_item,\n};\npub struct X;\n",
        ),
        ("c/src/b/deep.rs", "fn f() { crate::c::go(); }\n"),
        (
            "c/src/c.rs",
            "pub struct Z;\n#[cfg(test)]\nmod tests { use crate::a::Y; }\n",
        ),
        ("c/src/tests.rs", "use crate::a::Y;\n"),
    ]);
    let read = |path: &Path| files.get(path.to_str()?).map(|t| t.to_string());
    let found = modules(Path::new("c/src/lib.rs"), &read)?;
    let uses = graph(&found, Path::new("c"));
    let edges: BTreeSet<(&str, &str)> = uses
        .iter()
        .flat_map(|(from, to)| to.keys().map(move |to| (from.as_str(), to.as_str())))
        .collect();
    assert_eq!(
        edges,
        BTreeSet::from([
            ("a", "b"),
            ("b", "crate"),
            ("b", "inline"),
            ("b::deep", "c"),
            ("inline", "c"),
        ])
    );
    assert_eq!(find_cycle(&uses), None);

    // Test code made production code: c uses a, a uses b, b's child uses c.
    let mut circle = files.clone();
    circle.insert("c/src/c.rs", "pub struct Z;\nfn g() { crate::a::go(); }\n");
    let read = |path: &Path| circle.get(path.to_str()?).map(|t| t.to_string());
    let found = modules(Path::new("c/src/lib.rs"), &read)?;
    let uses = graph(&found, Path::new("c"));
    let cycle = find_cycle(&uses).ok_or("no circle found")?;
    assert_eq!(cycle, ["a", "b", "inline", "c", "a"].map(String::from));
    assert_eq!(
        describe(&cycle, &uses),
        "a → b (src/a.rs:2), b → inline (src/b/mod.rs:2), inline → c (src/lib.rs:7), c → a (src/c.rs:2)"
    );
    Ok(())
}
