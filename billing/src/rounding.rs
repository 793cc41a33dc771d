//! One rounding rule for every document of an invoice (its JSON, the console's page, the PDF
//! and the CSV), so that whatever column a reader adds up comes to the total:
//!
//! - each line's amount is written exactly as rated, every significant decimal kept
//!   ([`crate::money::format_exact`]): `0.0000519`, never `0.00` or `0.000052`;
//! - the total is the lines' exact sum rounded once to the currency's minor unit (as the
//!   dashboards round, so the two agree to the cent);
//! - the difference is written as a rounding line, so the amounts with it add up to the total;
//! - where whole minor units are wanted (`amount_minor` in the JSON and the ledger of
//!   invoice lines), the total is apportioned over the lines by largest remainder: they add
//!   up to `total_minor`, each within one minor unit of its exact amount.

use crate::money::Exact;

/// The total: the exact amounts' sum, rounded once.
pub fn total_minor(exact: &[Exact], currency: &str) -> i64 {
    exact.iter().copied().sum::<Exact>().to_minor(currency)
}

/// What the total's one rounding added to the exact sum (negative when it took off).
pub fn rounding(exact: &[Exact], total_minor: i64, currency: &str) -> Exact {
    Exact::from_minor(total_minor, currency) - exact.iter().copied().sum::<Exact>()
}

/// Each amount's share of `total_minor` in minor units: its own rounding, then the units the
/// total has more (or fewer) than their sum given to the amounts rounded furthest the other
/// way, the earlier first on a tie.
pub fn apportion(exact: &[Exact], total_minor: i64, currency: &str) -> Vec<i64> {
    let unit = Exact::from_minor(1, currency).0;
    let mut shares: Vec<i64> = exact.iter().map(|e| e.to_minor(currency)).collect();
    let short = total_minor - shares.iter().sum::<i64>();
    if short == 0 || shares.is_empty() {
        return shares;
    }
    let mut residual: Vec<(usize, i128)> = exact
        .iter()
        .zip(&shares)
        .enumerate()
        .map(|(i, (e, s))| (i, e.0 - *s as i128 * unit))
        .collect();
    // Short: the most rounded down first; over: the most rounded up first.
    residual.sort_by(|a, b| {
        let (x, y) = if short > 0 { (b.1, a.1) } else { (a.1, b.1) };
        x.cmp(&y).then(a.0.cmp(&b.0))
    });
    let step = short.signum();
    for k in 0..short.unsigned_abs() as usize {
        shares[residual[k % residual.len()].0] += step;
    }
    shares
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::money::format_exact;

    fn nanos(n: &str) -> Exact {
        n.parse().unwrap()
    }

    /// Decimal strings summed exactly (as a reader's spreadsheet would, without floats).
    fn sum_decimal(xs: &[String]) -> Exact {
        xs.iter()
            .map(|x| {
                let (neg, x) = match x.strip_prefix('-') {
                    Some(rest) => (true, rest),
                    None => (false, x.as_str()),
                };
                let n = match x.split_once('.') {
                    Some((w, f)) => format!("{w}{f:0<18}").parse::<i128>().unwrap(),
                    None => x.parse::<i128>().unwrap() * 10i128.pow(18),
                };
                Exact(if neg { -n } else { n })
            })
            .sum()
    }

    #[test]
    fn three_lines_that_round_to_eleven_cents_apart_add_up_to_the_twelve_billed() {
        // 0.0449 + 0.0449 + 0.0299 = 0.1197: each rounds alone to 0.04 + 0.04 + 0.03 = 0.11;
        // the total is 0.12.
        let exact = [
            nanos("44900000.000000000"),
            nanos("44900000.000000000"),
            nanos("29900000.000000000"),
        ];
        let total = total_minor(&exact, "USD");
        assert_eq!(total, 12);
        // The unit goes to the line rounded furthest down (0.0299 → 0.03 was rounded up).
        assert_eq!(apportion(&exact, total, "USD"), [5, 4, 3]);
        let r = rounding(&exact, total, "USD");
        assert_eq!(format_exact(r, "USD"), "0.0003");
        let mut amounts: Vec<String> = exact.iter().map(|e| format_exact(*e, "USD")).collect();
        assert_eq!(amounts, ["0.0449", "0.0449", "0.0299"]);
        amounts.push(format_exact(r, "USD"));
        assert_eq!(sum_decimal(&amounts), Exact::from_minor(12, "USD"));
    }

    #[test]
    fn shares_add_up_and_stay_within_a_unit_of_their_exact_amounts() {
        // Credits and sub-cent lines, in several currencies, many shapes.
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for currency in ["USD", "JPY", "KWD"] {
            for _ in 0..500 {
                let n = (next() % 12) as usize;
                let exact: Vec<Exact> = (0..n)
                    .map(|_| {
                        Exact(((next() % 90_000_000_000) as i128 - 10_000_000_000) * 1_000_000)
                    })
                    .collect();
                let total = total_minor(&exact, currency);
                let shares = apportion(&exact, total, currency);
                assert_eq!(shares.iter().sum::<i64>(), total);
                let unit = Exact::from_minor(1, currency).0;
                for (e, s) in exact.iter().zip(&shares) {
                    let off = e.0 - *s as i128 * unit;
                    assert!(off.abs() <= unit, "{e:?} as {s}: off by {off}");
                }
                let r = rounding(&exact, total, currency);
                assert!(2 * r.0.abs() <= unit, "rounding {r:?}");
                let mut written: Vec<String> =
                    exact.iter().map(|e| format_exact(*e, currency)).collect();
                written.push(format_exact(r, currency));
                assert_eq!(sum_decimal(&written), Exact::from_minor(total, currency));
            }
        }
    }
}
