//! Results files: every JSON carries when, where and from which commit it came.

use serde::Serialize;
use std::path::Path;

/// Where and when a result was measured.
#[derive(Serialize)]
pub struct Meta {
    pub date: String,
    pub commit: &'static str,
    pub backend: gpufeed::BackendKind,
    pub device: String,
    pub driver: Option<String>,
    pub ptx_target: &'static str,
}

impl Meta {
    pub fn new(device: &gpufeed::Device) -> Meta {
        let info = device.info();
        Meta {
            date: utc_now(),
            commit: env!("HOST_GIT_COMMIT"),
            backend: info.backend,
            device: info.name.clone(),
            driver: info.driver.clone(),
            ptx_target: gpufeed::ptx::ARCH,
        }
    }
}

/// `YYYY-MM-DDTHH:MM:SSZ` from the system clock (no date crate needed).
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Writes `value` as pretty JSON, creating the directory.
pub fn write_json(path: &Path, value: &impl Serialize) -> gpufeed::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| gpufeed::Error::InvalidArgument(e.to_string()))?;
    std::fs::write(path, text)?;
    announce(path);
    Ok(())
}

/// Files written so far, in order (the demonstration counts them at the end).
static WRITTEN: std::sync::Mutex<Vec<std::path::PathBuf>> = std::sync::Mutex::new(Vec::new());

/// Says that `path` was written (every results file goes through here).
pub fn announce(path: &Path) {
    println!("wrote {}", path.display());
    if let Ok(mut w) = WRITTEN.lock() {
        w.push(path.to_path_buf());
    }
}

/// How many files have been announced.
pub fn written() -> usize {
    WRITTEN.lock().map_or(0, |w| w.len())
}

/// Writes `rows` as CSV with a header from their field names (the `csv`
/// crate); `None` fields are empty cells.
pub fn write_csv<R: Serialize>(
    path: &Path,
    rows: impl IntoIterator<Item = R>,
) -> gpufeed::Result<()> {
    let err = |e: csv::Error| gpufeed::Error::InvalidArgument(format!("{}: {e}", path.display()));
    let mut w = csv::Writer::from_path(path).map_err(err)?;
    for r in rows {
        w.serialize(r).map_err(err)?;
    }
    w.flush()?;
    announce(path);
    Ok(())
}

/// `v` rounded to `digits` decimals for a CSV cell; not-a-number and
/// infinities (nothing measured) become an empty cell.
pub fn cell(v: f64, digits: i32) -> Option<f64> {
    let p = 10f64.powi(digits);
    v.is_finite().then(|| (v * p).round() / p)
}

/// Median of a sample (sorted copy): the middle value, or the mean of the
/// two middle ones; NaN for an empty sample.
pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// The `p` quantile (nearest rank) of a sample.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[((s.len() - 1) as f64 * p).round() as usize]
}

/// Fresh random floats in [-1, 1), never zero (the library's generator).
pub fn random_floats(n: usize, seed: u64) -> Vec<f32> {
    let mut v = vec![0f32; n];
    gpufeed::testing::random_floats(&mut v, seed);
    v
}
