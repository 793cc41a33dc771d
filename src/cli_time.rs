//! The one way every `cachet` command reads times and durations.
//!
//! A time is RFC 3339 (`2026-11-01T12:00:00Z`), a date (`2026-11-01`, midnight UTC), or
//! `now`. A duration is a number with a unit: `90s`, `15m`, `24h`, `7d`.

use chrono::{DateTime, NaiveDate, TimeZone, Utc};

/// Help text for time arguments.
pub const TIME_HELP: &str =
    "RFC 3339 (2026-11-01T12:00:00Z), a date (2026-11-01 = midnight UTC), or now";

/// Parse a time (see the module docs).
pub fn parse_time(s: &str) -> Result<DateTime<Utc>, String> {
    let s = s.trim();
    if s == "now" {
        return Ok(Utc::now());
    }
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Ok(t.with_timezone(&Utc));
    }
    if let Ok(d) = NaiveDate::parse_from_str(s, "%Y-%m-%d") {
        return Ok(Utc.from_utc_datetime(&d.and_hms_opt(0, 0, 0).expect("midnight")));
    }
    Err(format!("{s:?} is not a time: use {TIME_HELP}"))
}

/// Parse a duration like `90s`, `15m`, `24h` or `7d`.
pub fn parse_duration(s: &str) -> Result<chrono::Duration, String> {
    let s = s.trim();
    let (n, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: i64 = n
        .parse()
        .map_err(|_| format!("{s:?} is not a duration: use a number and s, m, h or d (24h)"))?;
    let d = match unit {
        "s" => chrono::Duration::try_seconds(n),
        "m" => chrono::Duration::try_minutes(n),
        "h" => chrono::Duration::try_hours(n),
        "d" => chrono::Duration::try_days(n),
        _ => {
            return Err(format!(
                "{s:?} is not a duration: use a number and s, m, h or d (24h)"
            ));
        }
    };
    d.ok_or_else(|| format!("{s:?} is too long a duration"))
}

/// A time that must fall on midnight UTC (for commands over whole days).
pub fn whole_day(t: DateTime<Utc>, what: &str) -> Result<NaiveDate, String> {
    if t.time() != chrono::NaiveTime::MIN {
        return Err(format!(
            "{what}: {t} is not midnight UTC; this command works on whole days (give a date like 2026-11-01)"
        ));
    }
    Ok(t.date_naive())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_rfc3339_dates_or_now() {
        let t = parse_time("2026-11-01T12:00:00+01:00").unwrap();
        assert_eq!(t.to_rfc3339(), "2026-11-01T11:00:00+00:00");
        let d = parse_time("2026-11-01").unwrap();
        assert_eq!(d.to_rfc3339(), "2026-11-01T00:00:00+00:00");
        assert!(parse_time("now").is_ok());
        let e = parse_time("yesterday").unwrap_err();
        assert!(e.contains("RFC 3339"), "{e}");
        assert_eq!(whole_day(d, "--from").unwrap().to_string(), "2026-11-01");
        assert!(whole_day(t, "--from").unwrap_err().contains("midnight"));
    }

    #[test]
    fn durations_have_units() {
        assert_eq!(parse_duration("90s").unwrap().num_seconds(), 90);
        assert_eq!(parse_duration("15m").unwrap().num_seconds(), 900);
        assert_eq!(parse_duration("24h").unwrap().num_hours(), 24);
        assert_eq!(parse_duration("7d").unwrap().num_days(), 7);
        assert!(parse_duration("7").is_err());
        assert!(parse_duration("x7d").is_err());
        // Beyond what a duration can hold: an error, not a panic.
        assert!(parse_duration("9223372036854775807d").is_err());
        assert!(parse_duration("9223372036854775807s").is_err());
    }
}
