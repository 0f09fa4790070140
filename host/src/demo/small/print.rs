//! The tables `host small-transfers` prints: copies per second and GB/s per
//! mode and size, with the ratios, after a legend of the modes.

use crate::demo::fmt::{size, Words};
use crate::demo::small::config::{Direction, Mode, DIRECTIONS, MODES};
use crate::demo::small::results::{Results, Row};

/// `1.23M`, `456.7k`, `812`: copies per second in a table cell.
fn rate(v: Option<f64>) -> String {
    match v {
        Some(v) if v >= 1e6 => format!("{:.2}M", v / 1e6),
        Some(v) if v >= 1e3 => format!("{:.1}k", v / 1e3),
        Some(v) => format!("{v:.0}"),
        None => "-".into(),
    }
}

fn gb(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.2}"))
}

fn ratio(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.2}x"))
}

pub fn print(res: &Results) {
    let has_raw = res
        .rows
        .iter()
        .any(|r| r.mode.is_raw() && r.ops_per_s.is_some());
    legend(res, has_raw);
    for dir in DIRECTIONS {
        tables(res, dir, has_raw);
    }
    if !res.locked {
        println!(
            "note: the memlock limit refused to lock some host buffers; they ran as plain memory"
        );
    }
    if res.rows.iter().any(|r| r.verified == Some(false)) {
        println!("ERROR: some copies brought back wrong bytes (verified = false in the JSON)");
    }
}

/// What the modes and the ratio columns are.
fn legend(res: &Results, has_raw: bool) {
    let w = Words::for_kind(res.meta.backend);
    let rounds = res.rows.iter().map(|r| r.rounds).max().unwrap_or(0);
    println!(
        "\nsmall copies: copies per second (medians of {rounds} rounds) and GB/s; every mode on one stream except \"64 4 strms\" (four)."
    );
    println!("  run_sync 1  each copy waited for on the calling thread (Stream::run_sync) before the next");
    println!(
        "  awaited 1   each copy a job, awaited before the next (gpufeed::block_on; every awaited"
    );
    println!("              mode runs there but tokio 1: the same on tokio's Runtime::block_on)");
    println!(
        "  awaited 64  64 jobs kept in flight (a FuturesUnordered window over 64 buffer pairs)"
    );
    println!("  64 batch    64 jobs issued, then all awaited (try_join_all)");
    println!("  64 one job  one job issuing 64 copies, awaited");
    println!("  64 4 strms  the awaited 64 window, its jobs round robin over 4 streams");
    println!("  64 copy_batch  one job of one Commands::copy_batch of the 64 copies, awaited");
    if w.cpu {
        println!(
            "  raw 1/64    raw driver copies: not measured on the CPU emulation (no driver); the"
        );
        println!(
            "              emulation's copies are memcpy on a stream worker thread, the rates say"
        );
        println!("              nothing about a GPU.");
        if res.rows.iter().all(|r| r.bytes < 4 << 20) {
            println!("  (up to 1 MiB on the CPU emulation, to keep CI fast: `host small-transfers --sizes`");
            println!("  takes others, in bytes)");
        }
    } else if res.raw_note.is_some() {
        println!("  raw 1/64    raw driver copies: not measured (the driver's own context could not be set up)");
    } else {
        println!("  raw 1       cuMemcpy{{HtoD,DtoH}}Async + cuStreamSynchronize per copy (cudarc sys layer)");
        println!("  raw 64      64 of those copies, then one cuStreamSynchronize");
    }
    println!("Every mode's copies were checked byte for byte on fresh random data at every size.");
    if has_raw {
        println!("Ratios: copies per second of ours over the raw driver's (aw = awaited, sy = run_sync),");
        println!("and awaited over run_sync, one in flight.");
    } else {
        println!("aw1/sy1: copies per second awaited over run_sync, one in flight.");
    }
}

/// The two tables of one direction: copies per second (with the ratios),
/// and GB/s.
fn tables(res: &Results, dir: Direction, has_raw: bool) {
    let rows: Vec<&Row> = res.rows.iter().filter(|r| r.direction == dir).collect();
    let mut sizes: Vec<usize> = rows.iter().map(|r| r.bytes).collect();
    sizes.dedup();
    let get = |bytes: usize, m: Mode| rows.iter().find(|r| r.bytes == bytes && r.mode == m);
    println!("\n{} copies per second", dir.name());
    print!("{:>9}", "size");
    for m in MODES {
        print!(" {:>10}", m.short());
    }
    if has_raw {
        print!(" {:>9} {:>9} {:>9}", "aw1/raw1", "sy1/raw1", "aw64/r64");
    }
    println!(" {:>9}", "aw1/sy1");
    for &b in &sizes {
        print!("{:>9}", size(b));
        for m in MODES {
            print!(" {:>10}", rate(get(b, m).and_then(|r| r.ops_per_s)));
        }
        let r = res
            .ratios
            .iter()
            .find(|r| r.bytes == b && r.direction == dir);
        if has_raw {
            print!(
                " {:>9} {:>9} {:>9}",
                ratio(r.and_then(|r| r.awaited_1_vs_raw_1)),
                ratio(r.and_then(|r| r.run_sync_1_vs_raw_1)),
                ratio(r.and_then(|r| r.awaited_64_vs_raw_64))
            );
        }
        println!(" {:>9}", ratio(r.and_then(|r| r.awaited_1_vs_run_sync_1)));
    }
    println!("{} GB/s", dir.name());
    print!("{:>9}", "size");
    for m in MODES {
        print!(" {:>10}", m.short());
    }
    println!();
    for &b in &sizes {
        print!("{:>9}", size(b));
        for m in MODES {
            print!(" {:>10}", gb(get(b, m).and_then(|r| r.gb_per_s)));
        }
        println!();
    }
}
