//! The run against the books: the price book's rates for pricing the report, and the usage
//! every client saw compared with the ledger row of its request id, through the finance API
//! (`GET /v1/billing/prices`, `GET /v1/billing/exports/usage?format=jsonl`).

use std::collections::HashMap;
use std::io::BufRead;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use billing::money::Rates;
use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::client::Usage;
use crate::stats::RequestRecord;

/// Rates to price a run at, and where they came from.
#[derive(Clone, Debug)]
pub struct Prices {
    pub rates: Rates,
    pub currency: String,
    pub source: String,
}

impl Prices {
    /// Without a finance token: the list price Cachet ships for `model`
    /// (`billing::prices::list_default`), or for a model it ships none for, $3 / $15 per
    /// million input / output tokens; Cachet's multipliers (1.25× 5m write, 2× 1h write,
    /// 0.1× read).
    pub fn list_default(model: &str) -> Self {
        let rates = billing::prices::list_default(model).unwrap_or(Rates::standard(3_000, 15_000));
        Self {
            rates,
            currency: "USD".into(),
            source: "default list rates (no finance token)".into(),
        }
    }
}

/// The price version of `model` in force now, if the price book has one.
pub async fn price_book(
    client: &reqwest::Client,
    url: &str,
    token: &str,
    model: &str,
) -> anyhow::Result<Option<Prices>> {
    #[derive(Deserialize)]
    struct Version {
        model: String,
        effective_from: DateTime<Utc>,
        currency: String,
        #[serde(flatten)]
        rates: Rates,
    }
    let req = client
        .get(format!("{}/v1/billing/prices", url.trim_end_matches('/')))
        .bearer_auth(token);
    let text = crate::client::text_of(req, "the price book").await?;
    let v: Value = serde_json::from_str(&text).context("the price book's answer")?;
    let list = v.get("data").cloned().unwrap_or(v);
    let versions: Vec<Version> = serde_json::from_value(list).context("price versions")?;
    let now = Utc::now();
    Ok(versions
        .into_iter()
        .filter(|p| p.model == model && p.effective_from <= now)
        .max_by_key(|p| p.effective_from)
        .map(|p| Prices {
            rates: p.rates,
            currency: p.currency,
            source: format!("price book, {model} from {}", p.effective_from.to_rfc3339()),
        }))
}

/// What the comparison found.
#[derive(Clone, Debug, Default)]
pub struct Reconciliation {
    /// Answered requests compared.
    pub checked: u64,
    pub matched: u64,
    /// Answered requests with no ledger row (after waiting).
    pub missing: u64,
    /// Rows whose token counts differ from what the client saw.
    pub differing: u64,
    /// Failed requests that did get a row (partial answers are billed for what was sent).
    pub failed_with_rows: u64,
    /// Up to 20 differences, spelled out.
    pub examples: Vec<String>,
}

impl Reconciliation {
    pub fn exact(&self) -> bool {
        self.missing == 0 && self.differing == 0
    }

    pub fn to_json(&self) -> Value {
        json!({
            "checked": self.checked,
            "matched": self.matched,
            "missing": self.missing,
            "differing": self.differing,
            "failed_with_rows": self.failed_with_rows,
            "exact": self.exact(),
            "examples": self.examples,
        })
    }

    pub fn print(&self) {
        if self.exact() {
            println!(
                "reconciliation: exact ({} answered requests, each billed what its client saw)",
                self.checked
            );
        } else {
            println!(
                "reconciliation: DIFFERENCES: {} of {} answered requests ({} missing from the ledger, {} billed differently)",
                self.missing + self.differing,
                self.checked,
                self.missing,
                self.differing
            );
            for e in &self.examples {
                println!("  {e}");
            }
        }
    }
}

/// The five counts in the ledger's column order.
type Counts = [u64; 5];

fn counts(u: &Usage) -> Counts {
    [
        u.input_tokens,
        u.cache_write_5m_tokens,
        u.cache_write_1h_tokens,
        u.cache_read_tokens,
        u.output_tokens,
    ]
}

const NAMES: [&str; 5] = [
    "input_tokens",
    "cache_write_5m_tokens",
    "cache_write_1h_tokens",
    "cache_read_tokens",
    "output_tokens",
];

/// Compare every answered request in `records` with its ledger row. The ledger is read as a
/// stream of the run's window (a minute either side); rows of other traffic are ignored.
/// Rows land through the meter's batches: missing ones are asked again until `wait` ends.
pub async fn reconcile(
    client: &reqwest::Client,
    url: &str,
    token: &str,
    records: &Path,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    wait: Duration,
) -> anyhow::Result<Reconciliation> {
    // request id → what the client saw (answered requests); failed requests' ids apart.
    let mut want: HashMap<u128, Counts> = HashMap::new();
    let mut failed: std::collections::HashSet<u128> = Default::default();
    let f = std::fs::File::open(records)?;
    for line in std::io::BufReader::new(f).lines() {
        let r: RequestRecord = serde_json::from_str(&line?)?;
        let Some(id) = r.request_id.as_deref().and_then(parse_id) else {
            continue;
        };
        if r.error.is_none() {
            want.insert(id, counts(&r.usage));
        } else {
            failed.insert(id);
        }
    }
    let mut out = Reconciliation {
        checked: want.len() as u64,
        ..Default::default()
    };
    let deadline = Instant::now() + wait;
    let from = from - chrono::Duration::minutes(1);
    let to = to + chrono::Duration::minutes(1);
    loop {
        let mut found_failed = 0u64;
        let rows = ledger_rows(client, url, token, from, to).await?;
        for (id, got) in rows {
            if let Some(w) = want.remove(&id) {
                if w == got {
                    out.matched += 1;
                } else {
                    out.differing += 1;
                    if out.examples.len() < 20 {
                        let diffs: Vec<String> = (0..5)
                            .filter(|&i| w[i] != got[i])
                            .map(|i| format!("{} client {} ledger {}", NAMES[i], w[i], got[i]))
                            .collect();
                        out.examples
                            .push(format!("req_{:032x}: {}", id, diffs.join(", ")));
                    }
                }
            } else if failed.contains(&id) {
                found_failed += 1;
            }
        }
        out.failed_with_rows = out.failed_with_rows.max(found_failed);
        if want.is_empty() || Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    out.missing = want.len() as u64;
    for id in want.keys().take(20usize.saturating_sub(out.examples.len())) {
        out.examples.push(format!("req_{id:032x}: no ledger row"));
    }
    Ok(out)
}

fn parse_id(s: &str) -> Option<u128> {
    let hex = s.strip_prefix("req_").unwrap_or(s).replace('-', "");
    u128::from_str_radix(&hex, 16).ok()
}

/// The ledger's rows of `[from, to)`: request id → counts.
async fn ledger_rows(
    client: &reqwest::Client,
    url: &str,
    token: &str,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> anyhow::Result<Vec<(u128, Counts)>> {
    use futures::StreamExt;
    #[derive(Deserialize)]
    struct Row {
        request_id: String,
        input_tokens: u64,
        cache_write_5m_tokens: u64,
        cache_write_1h_tokens: u64,
        cache_read_tokens: u64,
        output_tokens: u64,
    }
    let resp = client
        .get(format!(
            "{}/v1/billing/exports/usage",
            url.trim_end_matches('/')
        ))
        .query(&[
            ("from", from.to_rfc3339()),
            ("to", to.to_rfc3339()),
            ("format", "jsonl".to_string()),
        ])
        .bearer_auth(token)
        .send()
        .await
        .context("reading the ledger export")?;
    let status = resp.status();
    if !status.is_success() {
        bail!(
            "the ledger export answered {status}: {}",
            resp.text().await.unwrap_or_default()
        );
    }
    let mut out = Vec::new();
    let mut buf: Vec<u8> = Vec::new();
    let mut body = resp.bytes_stream();
    let take = |line: &[u8], out: &mut Vec<(u128, Counts)>| -> anyhow::Result<()> {
        if line.iter().all(u8::is_ascii_whitespace) {
            return Ok(());
        }
        let r: Row = serde_json::from_slice(line).context("a ledger export line")?;
        if let Some(id) = parse_id(&r.request_id) {
            out.push((
                id,
                [
                    r.input_tokens,
                    r.cache_write_5m_tokens,
                    r.cache_write_1h_tokens,
                    r.cache_read_tokens,
                    r.output_tokens,
                ],
            ));
        }
        Ok(())
    };
    while let Some(chunk) = body.next().await {
        buf.extend_from_slice(&chunk.context("the ledger export was cut")?);
        while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=nl).collect();
            take(&line, &mut out)?;
        }
    }
    take(&buf, &mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_parse_in_both_spellings() {
        let u = "0190a3b2-7c4d-7e8f-9a0b-1c2d3e4f5a6b";
        let r = "req_0190a3b27c4d7e8f9a0b1c2d3e4f5a6b";
        assert_eq!(parse_id(u), parse_id(r));
        assert!(parse_id(u).is_some());
        assert_eq!(parse_id("msg_x"), None);
    }
}
