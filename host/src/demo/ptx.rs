//! `host ptx`: the PTX that build.rs compiled from `gpu-kernels` (the sm_70
//! build, or the sm_80 one with `--sm80`), and an inspection of each kernel:
//! the instructions that matter in its body (barriers, shuffles and votes,
//! atomics, shared-memory and read-only loads, tensor-core instructions,
//! local memory), and, where `ptxas` is found (`PTXAS`, else on `PATH`),
//! its registers, shared memory, stack and spills as `ptxas -v` reports
//! them. Written to `ptx.json` beside the printed table with `--json`.

use gpufeed::ptx;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;

/// The instructions counted, by the prefix they start with.
const WATCHED: &[(&str, &str)] = &[
    ("bar.sync", "bar.sync"),
    ("barrier", "barrier."),
    ("shfl.sync", "shfl.sync"),
    ("vote.sync", "vote.sync"),
    ("atom.shared", "atom.shared"),
    ("atom", "atom."),
    ("red", "red."),
    ("ld.shared", "ld.shared"),
    ("st.shared", "st.shared"),
    ("ld.global.nc", "ld.global.nc"),
    ("mma.sync", "mma.sync"),
    ("ldmatrix", "ldmatrix"),
    ("cp.async", "cp.async"),
    ("fma.rn.f32", "fma.rn.f32"),
    ("ld.local/st.local", "ld.local"),
];

/// One kernel as the PTX text and ptxas describe it.
#[derive(Serialize, Default)]
pub struct Entry {
    /// The `.entry` name.
    pub name: String,
    /// Counts of the watched instructions in its body.
    pub instructions: BTreeMap<String, usize>,
    /// What ptxas reports for it, where ptxas ran.
    pub ptxas: Option<Ptxas>,
}

/// What `ptxas -v` reports for one function.
#[derive(Serialize, Default, Clone)]
pub struct Ptxas {
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of static shared memory.
    pub shared_bytes: u32,
    /// Bytes of stack frame.
    pub stack_bytes: u32,
    /// Bytes spilled to local memory (stores).
    pub spill_stores: u32,
    /// Bytes reloaded from spills.
    pub spill_loads: u32,
}

/// The report `--json` writes.
#[derive(Serialize)]
pub struct Report {
    /// The PTX's `.target`.
    pub target: String,
    /// The ptxas run, if any: its command line and architecture.
    pub ptxas: Option<String>,
    /// Every kernel.
    pub entries: Vec<Entry>,
}

/// The body of each `.entry` (from its line to the next entry's).
fn bodies(text: &str) -> Vec<(String, &str)> {
    let starts: Vec<(usize, &str)> = text
        .match_indices(".entry ")
        .filter_map(|(i, _)| {
            let rest = &text[i + 7..];
            let name = rest.split(['(', ' ', '\n']).next()?;
            Some((i, name))
        })
        .collect();
    starts
        .iter()
        .enumerate()
        .map(|(k, &(i, name))| {
            let end = starts.get(k + 1).map_or(text.len(), |s| s.0);
            (name.to_string(), &text[i..end])
        })
        .collect()
}

fn count(body: &str) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for line in body.lines() {
        let ins = line.trim_start();
        let ins = ins.strip_prefix('@').map_or(ins, |p| {
            p.split_once(char::is_whitespace)
                .map_or(p, |(_, r)| r.trim_start())
        });
        for (label, prefix) in WATCHED {
            let hit = match *label {
                "atom" => ins.starts_with("atom.") && !ins.starts_with("atom.shared"),
                "ld.local/st.local" => ins.starts_with("ld.local") || ins.starts_with("st.local"),
                _ => ins.starts_with(prefix),
            };
            if hit {
                *out.entry((*label).to_string()).or_insert(0) += 1;
            }
        }
    }
    out
}

/// `ptxas -v` over the PTX, parsed per function; `None` without ptxas.
fn ptxas(text: &str, arch: &str) -> Option<(String, BTreeMap<String, Ptxas>)> {
    let exe = std::env::var("PTXAS").unwrap_or_else(|_| "ptxas".into());
    let dir = std::env::temp_dir().join(format!("host-ptx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).ok()?;
    let input = dir.join("kernels.ptx");
    std::fs::write(&input, text).ok()?;
    let out = std::process::Command::new(&exe)
        .args([&format!("-arch={arch}"), "-v"])
        .arg(&input)
        .args(["-o", "/dev/null"])
        .output()
        .ok();
    let _ = std::fs::remove_dir_all(&dir);
    let out = out?;
    if !out.status.success() {
        eprintln!("ptxas failed: {}", String::from_utf8_lossy(&out.stderr));
        return None;
    }
    let log =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    let mut map = BTreeMap::new();
    let mut current: Option<String> = None;
    let num = |s: &str, key: &str| -> Option<u32> {
        let i = s.find(key)?;
        s[..i].split_whitespace().last()?.parse().ok()
    };
    for line in log.lines() {
        if let Some(i) = line.find("Compiling entry function '") {
            let rest = &line[i + 26..];
            current = rest.split('\'').next().map(str::to_string);
        } else if let Some(name) = &current {
            let e: &mut Ptxas = map.entry(name.clone()).or_default();
            if line.contains("stack frame") {
                e.stack_bytes = num(line, "bytes stack frame").unwrap_or(0);
                e.spill_stores = num(line, "bytes spill stores").unwrap_or(0);
                e.spill_loads = num(line, "bytes spill loads").unwrap_or(0);
            } else if line.contains("Used") && line.contains("registers") {
                e.registers = num(line, "registers").unwrap_or(0);
                e.shared_bytes = num(line, "bytes smem").unwrap_or(0);
            }
        }
    }
    Some((format!("{exe} -arch={arch} -v"), map))
}

/// The inspection of one PTX text.
pub fn inspect(text: &str, ptxas_arch: &str) -> Report {
    let run = ptxas(text, ptxas_arch);
    let entries = bodies(text)
        .into_iter()
        .map(|(name, body)| Entry {
            instructions: count(body),
            ptxas: run.as_ref().and_then(|(_, m)| m.get(&name).cloned()),
            name,
        })
        .collect();
    Report {
        target: ptx::target(text).unwrap_or("?").to_string(),
        ptxas: run.map(|(cmd, _)| cmd),
        entries,
    }
}

fn table(r: &Report) {
    eprintln!(
        "{:<16} {:>5} {:>6} {:>6} {:>6}  instructions",
        "kernel", "regs", "smem", "stack", "spill"
    );
    for e in &r.entries {
        let p = e.ptxas.as_ref();
        let f = |v: Option<u32>| v.map_or("-".to_string(), |v| v.to_string());
        let ins: Vec<String> = e
            .instructions
            .iter()
            .filter(|(k, _)| k.as_str() != "fma.rn.f32")
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        eprintln!(
            "{:<16} {:>5} {:>6} {:>6} {:>6}  {}",
            e.name,
            f(p.map(|p| p.registers)),
            f(p.map(|p| p.shared_bytes)),
            f(p.map(|p| p.stack_bytes)),
            f(p.map(|p| p.spill_stores + p.spill_loads)),
            ins.join(", ")
        );
    }
    match &r.ptxas {
        Some(cmd) => eprintln!("registers, shared memory, stack and spills: {cmd}"),
        None => eprintln!("(no ptxas found: set PTXAS or put it on PATH for registers and spills)"),
    }
}

pub fn run(out: Option<&Path>, sm80: bool, json: Option<&Path>) -> gpufeed::Result<()> {
    let text = if sm80 { ptx::PTX_SM80 } else { ptx::PTX };
    match out {
        Some(path) => {
            std::fs::write(path, text)?;
            eprintln!(
                "wrote {} ({})",
                path.display(),
                super::fmt::size(text.len())
            );
        }
        None => print!("{text}"),
    }
    eprintln!("target: {}", ptx::target(text).unwrap_or("?"));
    eprintln!("entry points: {}", ptx::entry_points(text).join(", "));
    let report = inspect(text, if sm80 { "sm_80" } else { "sm_70" });
    table(&report);
    if let Some(path) = json {
        let s = serde_json::to_string_pretty(&report)
            .map_err(|e| gpufeed::Error::InvalidArgument(format!("ptx report: {e}")))?;
        std::fs::write(path, s)?;
    }
    Ok(())
}
