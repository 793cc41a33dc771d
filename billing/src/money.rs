//! Money without floats: exact amounts and the one rounding rule.
//!
//! Prices are integers (nano-units of the currency per token; multipliers in basis points;
//! discounts in basis points off). An [`Exact`] amount is an integer count of 10⁻¹⁸ currency
//! units ("atto"), which every product of those integers fits exactly: a usage line is
//! `tokens × nanos × multiplier_bp × (10000 − discount_bp)` × 10 atto, a reserved-capacity line
//! `bytes × hours × nanos_per_GB_hour` atto. Nothing is rounded until an amount becomes an
//! invoice line: then it is rounded **once, half away from zero, to the currency's minor
//! unit** ([`Exact::to_minor`]). Totals are sums of rounded lines.
//!
//! One amount is not a whole number of atto: storage of cache objects ([`Exact::storage`]) is
//! priced per token-hour and metered in token-seconds, so its product is divided by 3600 and
//! rounded to the atto (10⁻¹⁸, half away from zero) before anything else; what reaches an
//! invoice is still rounded once to the minor unit.

use std::fmt;

use serde::{Deserialize, Serialize};
use sqlx::FromRow;
use utoipa::ToSchema;

/// Atto-units per nano-unit.
const ATTO_PER_NANO: i128 = 1_000_000_000;

/// An exact amount in 10⁻¹⁸ units of a currency.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Exact(pub i128);

/// Digits of a currency's minor unit (ISO 4217): 0 for JPY and KRW, 3 for the dinars, else 2.
pub fn minor_digits(currency: &str) -> u32 {
    match currency {
        "JPY" | "KRW" | "VND" | "CLP" | "ISK" => 0,
        "BHD" | "KWD" | "OMR" | "JOD" | "TND" => 3,
        _ => 2,
    }
}

/// The usage classes of a ledger row, each priced exactly once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TokenClass {
    Input,
    CacheWrite5m,
    CacheWrite1h,
    CacheRead,
    Output,
}

impl TokenClass {
    pub const ALL: [TokenClass; 5] = [
        TokenClass::Input,
        TokenClass::CacheWrite5m,
        TokenClass::CacheWrite1h,
        TokenClass::CacheRead,
        TokenClass::Output,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            TokenClass::Input => "input",
            TokenClass::CacheWrite5m => "cache_write_5m",
            TokenClass::CacheWrite1h => "cache_write_1h",
            TokenClass::CacheRead => "cache_read",
            TokenClass::Output => "output",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.as_str() == s)
    }
}

/// Token counts of the five classes, one field each, named as the ledger's columns: the one
/// word every report, export and overview counts tokens in (flattened into them, so their
/// JSON keeps these names). A new class is a field here and a [`TokenClass`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, FromRow, ToSchema)]
pub struct TokenCounts {
    pub input_tokens: i64,
    pub cache_write_5m_tokens: i64,
    pub cache_write_1h_tokens: i64,
    pub cache_read_tokens: i64,
    pub output_tokens: i64,
}

impl TokenCounts {
    pub fn of(&self, class: TokenClass) -> i64 {
        match class {
            TokenClass::Input => self.input_tokens,
            TokenClass::CacheWrite5m => self.cache_write_5m_tokens,
            TokenClass::CacheWrite1h => self.cache_write_1h_tokens,
            TokenClass::CacheRead => self.cache_read_tokens,
            TokenClass::Output => self.output_tokens,
        }
    }

    fn of_mut(&mut self, class: TokenClass) -> &mut i64 {
        match class {
            TokenClass::Input => &mut self.input_tokens,
            TokenClass::CacheWrite5m => &mut self.cache_write_5m_tokens,
            TokenClass::CacheWrite1h => &mut self.cache_write_1h_tokens,
            TokenClass::CacheRead => &mut self.cache_read_tokens,
            TokenClass::Output => &mut self.output_tokens,
        }
    }

    pub fn add(&mut self, o: &TokenCounts) {
        for class in TokenClass::ALL {
            *self.of_mut(class) += o.of(class);
        }
    }

    /// Prompt tokens of every class (what a request without any cache would bill as input).
    pub fn prompt(&self) -> i64 {
        TokenClass::ALL
            .into_iter()
            .filter(|c| *c != TokenClass::Output)
            .map(|c| self.of(c))
            .sum()
    }
}

/// One price version's rates: per token of each class, as a base price in nano-units and a
/// multiplier of it in basis points. Read from JSON, a multiplier left out is the standard
/// one (1.25× 5m write, 2× 1h write, 0.1× read, 1× per token-hour held).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, FromRow, ToSchema)]
pub struct Rates {
    pub input_nanos: i64,
    pub output_nanos: i64,
    #[serde(default = "standard::write_5m")]
    pub cache_write_5m_bp: i32,
    #[serde(default = "standard::write_1h")]
    pub cache_write_1h_bp: i32,
    #[serde(default = "standard::read")]
    pub cache_read_bp: i32,
    /// Holding a cache object, per token and hour, as a multiplier of the input price.
    #[serde(default = "standard::storage_hour")]
    pub cache_storage_hour_bp: i32,
}

/// The standard multipliers (basis points of the input price).
pub mod standard {
    pub const fn write_5m() -> i32 {
        12_500
    }
    pub const fn write_1h() -> i32 {
        20_000
    }
    pub const fn read() -> i32 {
        1_000
    }
    /// 1× the input price per token and hour held.
    pub const fn storage_hour() -> i32 {
        10_000
    }
}

impl Rates {
    /// `input_nanos` and `output_nanos` per token, with the standard multipliers.
    pub const fn standard(input_nanos: i64, output_nanos: i64) -> Self {
        Self {
            input_nanos,
            output_nanos,
            cache_write_5m_bp: standard::write_5m(),
            cache_write_1h_bp: standard::write_1h(),
            cache_read_bp: standard::read(),
            cache_storage_hour_bp: standard::storage_hour(),
        }
    }

    /// The per-token price of a class as (nanos, multiplier in basis points).
    pub fn of(&self, class: TokenClass) -> (i64, i32) {
        match class {
            TokenClass::Input => (self.input_nanos, 10_000),
            TokenClass::Output => (self.output_nanos, 10_000),
            TokenClass::CacheWrite5m => (self.input_nanos, self.cache_write_5m_bp),
            TokenClass::CacheWrite1h => (self.input_nanos, self.cache_write_1h_bp),
            TokenClass::CacheRead => (self.input_nanos, self.cache_read_bp),
        }
    }
}

impl Exact {
    pub const ZERO: Exact = Exact(0);

    /// `tokens` of `class` at `rates`, less `discount_bp` basis points.
    pub fn usage(tokens: i64, rates: &Rates, class: TokenClass, discount_bp: i32) -> Exact {
        let (nanos, bp) = rates.of(class);
        // nanos × bp/10⁴ × (10⁴ − d)/10⁴ nano-units = … × 10⁻¹⁷ units = … × 10 atto.
        Exact(tokens as i128 * nanos as i128 * bp as i128 * (10_000 - discount_bp as i128) * 10)
    }

    /// Cache objects held: `token_seconds` (tokens × seconds held) at `rates`' storage price
    /// (the input price × `cache_storage_hour_bp` per token-hour), less `discount_bp`; the one
    /// amount rounded to the atto (see the module's doc).
    pub fn storage(token_seconds: i64, rates: &Rates, discount_bp: i32) -> Exact {
        let per_hour = token_seconds as i128
            * rates.input_nanos as i128
            * rates.cache_storage_hour_bp as i128
            * (10_000 - discount_bp as i128)
            * 10;
        let (q, r) = (per_hour / 3600, per_hour % 3600);
        Exact(if 2 * r.abs() >= 3600 {
            q + per_hour.signum()
        } else {
            q
        })
    }

    /// Reserved capacity: `bytes` committed for `hours` at `nanos_per_gb_hour` (GB = 10⁹ B).
    pub fn reserved(bytes: i64, hours: i64, nanos_per_gb_hour: i64) -> Exact {
        // bytes/10⁹ × hours × nanos nano-units = bytes × hours × nanos atto.
        Exact(bytes as i128 * hours as i128 * nanos_per_gb_hour as i128)
    }

    pub fn from_minor(minor: i64, currency: &str) -> Exact {
        Exact(minor as i128 * atto_per_minor(currency))
    }

    /// Rounded to the currency's minor unit, half away from zero: the only rounding.
    pub fn to_minor(self, currency: &str) -> i64 {
        let unit = atto_per_minor(currency);
        let (q, r) = (self.0 / unit, self.0 % unit);
        let q = if 2 * r.abs() >= unit {
            q + self.0.signum()
        } else {
            q
        };
        q as i64
    }

    /// The exact amount in nano-units as a decimal string (9 decimals), for the audit
    /// column `exact_nanos`.
    pub fn nanos_decimal(self) -> String {
        let sign = if self.0 < 0 { "-" } else { "" };
        let v = self.0.unsigned_abs();
        let per = ATTO_PER_NANO as u128;
        format!("{sign}{}.{:09}", v / per, v % per)
    }
}

impl std::str::FromStr for Exact {
    type Err = String;

    /// The inverse of [`Exact::nanos_decimal`]: a decimal number of nano-units (as stored in
    /// `exact_nanos`), at most 9 decimals.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || format!("{s:?} is not a decimal amount of nano-units");
        let (neg, digits) = match s.strip_prefix('-') {
            Some(rest) => (true, rest),
            None => (false, s),
        };
        let (whole, frac) = digits.split_once('.').unwrap_or((digits, ""));
        if whole.is_empty()
            || frac.len() > 9
            || !whole
                .bytes()
                .chain(frac.bytes())
                .all(|b| b.is_ascii_digit())
        {
            return Err(bad());
        }
        let whole: i128 = whole.parse().map_err(|_| bad())?;
        let frac: i128 = if frac.is_empty() {
            0
        } else {
            format!("{frac:0<9}").parse().map_err(|_| bad())?
        };
        let v = whole
            .checked_mul(ATTO_PER_NANO)
            .and_then(|w| w.checked_add(frac))
            .ok_or_else(bad)?;
        Ok(Exact(if neg { -v } else { v }))
    }
}

fn atto_per_minor(currency: &str) -> i128 {
    10i128.pow(18 - minor_digits(currency))
}

impl std::ops::Add for Exact {
    type Output = Exact;
    fn add(self, o: Exact) -> Exact {
        Exact(self.0 + o.0)
    }
}

impl std::ops::Sub for Exact {
    type Output = Exact;
    fn sub(self, o: Exact) -> Exact {
        Exact(self.0 - o.0)
    }
}

impl std::iter::Sum for Exact {
    fn sum<I: Iterator<Item = Exact>>(iter: I) -> Exact {
        Exact(iter.map(|e| e.0).sum())
    }
}

/// An exact amount in the currency's major unit with every significant decimal kept (at
/// least the minor unit's): `0.0000519`, `12.50`, `-0.0049`. The one way an invoice line's
/// amount is written, in its JSON (`amount`), on the console's page, in the PDF and the CSV.
pub fn format_exact(e: Exact, currency: &str) -> String {
    let min = minor_digits(currency) as usize;
    let sign = if e.0 < 0 { "-" } else { "" };
    let v = e.0.unsigned_abs();
    let unit = 10u128.pow(18);
    let frac = format!("{:018}", v % unit);
    let frac = frac.trim_end_matches('0');
    let frac = format!("{frac:0<min$}");
    if frac.is_empty() {
        format!("{sign}{}", v / unit)
    } else {
        format!("{sign}{}.{frac}", v / unit)
    }
}

/// Minor units as a decimal string (`1234` USD → `12.34`).
pub fn format_minor(minor: i64, currency: &str) -> String {
    let d = minor_digits(currency);
    if d == 0 {
        return minor.to_string();
    }
    let unit = 10i64.pow(d);
    let sign = if minor < 0 { "-" } else { "" };
    let v = minor.unsigned_abs();
    format!(
        "{sign}{}.{:0width$}",
        v / unit as u64,
        v % unit as u64,
        width = d as usize
    )
}

impl fmt::Display for TokenClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn exact_amounts_keep_every_significant_decimal() {
        assert_eq!(format_exact(Exact(360_000_000_000_000), "USD"), "0.00036");
        assert_eq!(
            format_exact(Exact(12_500_000_000_000_000_000), "USD"),
            "12.50"
        );
        assert_eq!(format_exact(Exact(-1), "USD"), "-0.000000000000000001");
        assert_eq!(format_exact(Exact(5 * 10i128.pow(18)), "JPY"), "5");
    }

    const SONNET: Rates = Rates::standard(3_000, 15_000);

    proptest! {
        #[test]
        fn exact_amounts_round_trip_through_their_stored_text(v in any::<i64>(), f in 0i128..1_000_000_000) {
            let e = Exact(v as i128 * 1_000_000_000 + f);
            prop_assert_eq!(e.nanos_decimal().parse::<Exact>(), Ok(e));
        }
    }

    #[test]
    fn stored_amounts_parse_as_postgres_prints_them() {
        assert_eq!("3000000".parse::<Exact>(), Ok(Exact(3_000_000_000_000_000)));
        assert_eq!("0.5".parse::<Exact>(), Ok(Exact(500_000_000)));
        assert_eq!("-12.000000001".parse::<Exact>(), Ok(Exact(-12_000_000_001)));
        for bad in ["", ".5", "1.0000000001", "1e5", "--1", "1.2.3"] {
            assert!(bad.parse::<Exact>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn cache_multipliers_are_exact() {
        // 1M tokens at $3/MTok: input $3, 5m write $3.75, 1h write $6, read $0.30.
        let m = 1_000_000;
        assert_eq!(
            Exact::usage(m, &SONNET, TokenClass::Input, 0).to_minor("USD"),
            300
        );
        assert_eq!(
            Exact::usage(m, &SONNET, TokenClass::CacheWrite5m, 0).to_minor("USD"),
            375
        );
        assert_eq!(
            Exact::usage(m, &SONNET, TokenClass::CacheWrite1h, 0).to_minor("USD"),
            600
        );
        assert_eq!(
            Exact::usage(m, &SONNET, TokenClass::CacheRead, 0).to_minor("USD"),
            30
        );
        assert_eq!(
            Exact::usage(m, &SONNET, TokenClass::Output, 0).to_minor("USD"),
            1500
        );
        // 10% off $3.75 is $3.375: exact until rounded, then half away from zero.
        let d = Exact::usage(m, &SONNET, TokenClass::CacheWrite5m, 1_000);
        assert_eq!(d.nanos_decimal(), "3375000000.000000000");
        assert_eq!(d.to_minor("USD"), 338);
        assert_eq!(Exact(-d.0).to_minor("USD"), -338);
    }

    #[test]
    fn rounding_happens_once_not_per_row() {
        // 1,000 rows of one token at $0.25/MTok × 0.1 are $0.000025 exactly: each rounds to
        // 0 cents, the sum is 0.0025 cents → 0; 10⁶ rows are $25 and must be 2500, not 0.
        let cheap = Rates {
            input_nanos: 250,
            ..SONNET
        };
        let one = Exact::usage(1, &cheap, TokenClass::CacheRead, 0);
        let million: Exact = std::iter::repeat_n(one, 1_000_000).sum();
        assert_eq!(million.to_minor("USD"), 3);
        assert_eq!(
            Exact::usage(1_000_000, &cheap, TokenClass::CacheRead, 0),
            million
        );
    }

    #[test]
    fn storage_is_priced_per_token_hour_and_metered_per_second() {
        // 1M tokens held a whole hour at $3/MTok × 1.0 per hour: $3; half an hour: $1.50.
        let m = 1_000_000;
        assert_eq!(Exact::storage(m * 3600, &SONNET, 0).to_minor("USD"), 300);
        assert_eq!(Exact::storage(m * 1800, &SONNET, 0).to_minor("USD"), 150);
        // A day of a 100K-token object at 0.5× with 10% off: 2.4M token-hours × $1.5/MTok × 0.9.
        let half = Rates {
            cache_storage_hour_bp: 5_000,
            ..SONNET
        };
        let day = Exact::storage(100_000 * 86_400, &half, 1_000);
        assert_eq!(day.nanos_decimal(), "3240000000.000000000");
        // One token-second at 1 nano: 10⁹ / 3600 atto, rounded to the atto (277,777.7… → 277,778).
        let tiny = Rates {
            input_nanos: 1,
            ..SONNET
        };
        assert_eq!(Exact::storage(1, &tiny, 0), Exact(277_778));
        assert_eq!(Exact::storage(0, &SONNET, 0), Exact::ZERO);
    }

    #[test]
    fn minor_units_follow_the_currency() {
        let e = Exact::usage(1_000_000, &SONNET, TokenClass::Input, 0);
        assert_eq!(e.to_minor("JPY"), 3);
        assert_eq!(e.to_minor("KWD"), 3_000);
        assert_eq!(format_minor(1234, "USD"), "12.34");
        assert_eq!(format_minor(-5, "USD"), "-0.05");
        assert_eq!(format_minor(1234, "JPY"), "1234");
        assert_eq!(
            Exact::reserved(2_000_000_000, 720, 10_000_000).to_minor("USD"),
            1440
        );
    }

    proptest! {
        /// Rounding is half away from zero and never off by more than half a minor unit.
        #[test]
        fn rounding_is_within_half_a_unit(atto in -10i128.pow(30)..10i128.pow(30)) {
            let unit = 10i128.pow(16);
            let m = Exact(atto).to_minor("USD") as i128;
            let err = atto - m * unit;
            prop_assert!(2 * err.abs() <= unit);
            if 2 * err.abs() == unit {
                prop_assert!(m.abs() * unit > atto.abs(), "ties go away from zero");
            }
        }
    }
}
