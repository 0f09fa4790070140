//! The progress bar the demonstration's parts show.

use indicatif::{ProgressBar, ProgressStyle};

/// A progress bar on stderr; hidden when stderr is not a terminal (indicatif's
/// default), so logs and pipes get only the results. No time-left estimate:
/// the steps of a part differ in length by orders of magnitude.
pub fn bar(len: u64) -> ProgressBar {
    let pb = ProgressBar::new(len);
    if let Ok(style) =
        ProgressStyle::with_template("  [{bar:30}] {percent:>3}% {elapsed:>4}  {wide_msg}")
    {
        pb.set_style(style.progress_chars("=> "));
    }
    pb
}
