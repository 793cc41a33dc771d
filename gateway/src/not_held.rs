//! Cache writes the fabric did not hold, counted per tenant and reason in this process until
//! the change feed's loop adds them to the database ([`crate::sync`],
//! `control::tenants::refusals`): the console shows them beside usage, so a tenant whose
//! writes are refused for its quota sees why its usage shows no cache writes.

use std::collections::HashMap;
use std::sync::Mutex;

use cachet_common::TenantId;

use crate::metrics;

/// Breakpoints and tokens not held, per tenant and reason.
type Counts = HashMap<(TenantId, &'static str), (u64, u64)>;

/// Counts since the last [`NotHeld::take`].
#[derive(Default)]
pub struct NotHeld(Mutex<Counts>);

impl NotHeld {
    /// One breakpoint of `tenant` not held for `reason`, `tokens` of prompt charged as input.
    pub fn record(&self, tenant: TenantId, reason: &'static str, tokens: u64) {
        metrics::WRITES_NOT_HELD.with_label_values(&[reason]).inc();
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let c = m.entry((tenant, reason)).or_default();
        c.0 += 1;
        c.1 += tokens;
    }

    /// The counts since the last call.
    pub fn take(&self) -> Vec<control::tenants::refusals::NotHeld> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()))
            .into_iter()
            .map(
                |((t, reason), (breakpoints, tokens))| control::tenants::refusals::NotHeld {
                    tenant: t.as_uuid(),
                    reason,
                    breakpoints,
                    tokens,
                },
            )
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_add_up_per_tenant_and_reason_and_are_taken_once() {
        let n = NotHeld::default();
        let (a, b) = (TenantId::new(), TenantId::new());
        n.record(a, "quota", 100);
        n.record(a, "quota", 50);
        n.record(a, "capacity", 7);
        n.record(b, "quota", 1);
        let mut got: Vec<_> = n
            .take()
            .into_iter()
            .map(|r| (r.tenant == a.as_uuid(), r.reason, r.breakpoints, r.tokens))
            .collect();
        got.sort();
        assert_eq!(
            got,
            vec![
                (false, "quota", 1, 1),
                (true, "capacity", 1, 7),
                (true, "quota", 2, 150)
            ]
        );
        assert!(n.take().is_empty());
    }
}
