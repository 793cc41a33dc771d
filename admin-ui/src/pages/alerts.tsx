// Where a tenant's budget alerts go (signed webhooks) and what was sent: each threshold of
// the budget (the alert percentage, and 100%) is sent once a month, retried until delivered.

import { useState } from "preact/hooks";
import { api } from "../api";
import { Confirm, Dialog, ErrorBanner, Field, FormFooter, Loaded, Notice, SecretDialog, Table, useAction, useAsync } from "../components/ui";
import { formatTime } from "../format";
import type { Tenant, WebhookDelivery, WebhookEndpoint } from "../types";

export function AlertsTab({ tenant, canEdit }: { tenant: Tenant; canEdit: boolean }) {
  const base = `/v1/admin/tenants/${tenant.id}/webhooks`;
  const endpoints = useAsync(() => api<{ data: WebhookEndpoint[] }>("GET", base), [tenant.id]);
  const deliveries = useAsync(() => api<{ data: WebhookDelivery[] }>("GET", `${base}/deliveries?limit=200`), [tenant.id]);
  const [adding, setAdding] = useState(false);
  const [disabling, setDisabling] = useState<WebhookEndpoint | null>(null);
  const [secret, setSecret] = useState<string | null>(null);
  const [notice, setNotice] = useState<string | null>(null);
  const live = tenant.state !== "deleted" && canEdit;
  return (
    <section aria-labelledby="alerts-title">
      <h2 id="alerts-title">Budget alerts</h2>
      <p>
        When spend this month reaches the alert percentage of the budget, and again when it reaches the budget, Cachet POSTs a
        signed <code>budget.threshold_crossed</code> event to each endpoint below, once per threshold and month. Verify the{" "}
        <code>cachet-signature</code> header (<code>t=…,v1=…</code>: HMAC-SHA-256 of <code>"t.body"</code> with the endpoint's
        secret); a failed delivery is retried with backoff.
      </p>
      {live && (
        <button type="button" onClick={() => setAdding(true)}>
          Add endpoint
        </button>
      )}
      <Notice text={notice} />
      <Loaded state={endpoints} what="endpoints">
        <Table caption="Endpoints" columns={["URL", "Secret", "State", "Created", "Actions"]}>
          <tbody>
            {endpoints.data?.data.map((e) => (
              <tr key={e.id} data-endpoint={e.url}>
                <td>
                  <code>{e.url}</code>
                </td>
                <td>
                  <code>{e.secret_prefix}…</code>
                </td>
                <td class={e.disabled_at ? "state-revoked" : "state-active"}>{e.disabled_at ? "disabled" : "active"}</td>
                <td>{formatTime(e.created_at)}</td>
                <td>
                  {live && !e.disabled_at && (
                    <button type="button" class="danger" onClick={() => setDisabling(e)} aria-label={`Disable ${e.url}`}>
                      Disable
                    </button>
                  )}
                </td>
              </tr>
            ))}
          </tbody>
        </Table>
      </Loaded>
      <h3>Delivery log</h3>
      <button type="button" class="secondary" onClick={() => deliveries.reload()}>
        Refresh
      </button>
      <ErrorBanner error={deliveries.error} />
      <Table
        caption="Deliveries, newest first"
        columns={["Event", "Threshold", "Endpoint", "State", "Attempts", "Last answer", "Created"]}
      >
        <tbody>
          {deliveries.data?.data.map((d) => {
            const data = d.payload.data ?? {};
            return (
              <tr key={d.id} data-delivery={d.event_id}>
                <td>
                  <code>{d.event_type}</code>
                </td>
                <td>
                  {data.threshold_percent}% {data.workspace_id ? "(workspace)" : ""} · {data.spent} of {data.limit} {data.currency}
                </td>
                <td>
                  <code>{d.url}</code>
                </td>
                <td class={d.state === "delivered" ? "state-active" : d.state === "failed" ? "state-revoked" : "state-rotating"}>
                  {d.state}
                  {d.state === "pending" && d.next_attempt_at ? ` (next ${formatTime(d.next_attempt_at)})` : ""}
                </td>
                <td>{d.attempts}</td>
                <td>{d.last_status !== null ? `HTTP ${d.last_status}` : (d.last_error ?? "—")}</td>
                <td>{formatTime(d.created_at)}</td>
              </tr>
            );
          })}
          {deliveries.data?.data.length === 0 && (
            <tr>
              <td colSpan={7}>Nothing sent yet.</td>
            </tr>
          )}
        </tbody>
      </Table>
      <AddEndpointDialog
        open={adding}
        base={base}
        onClose={() => setAdding(false)}
        onAdded={(s) => {
          setAdding(false);
          endpoints.reload();
          setSecret(s);
        }}
      />
      <Confirm
        open={disabling !== null}
        title={`Disable ${disabling?.url ?? ""}?`}
        body={<p>Nothing more is sent to it; deliveries still pending to it are dropped.</p>}
        action="Disable"
        danger
        onClose={() => setDisabling(null)}
        onConfirm={async () => {
          await api("POST", `${base}/${disabling!.id}/disable`);
          endpoints.reload();
          deliveries.reload();
          setNotice("Endpoint disabled.");
        }}
      />
      <SecretDialog
        title="Endpoint added"
        secret={secret}
        note="Copy the signing secret now: it is shown this once."
        onClose={() => setSecret(null)}
      />
    </section>
  );
}

function AddEndpointDialog(props: { open: boolean; base: string; onClose: () => void; onAdded: (secret: string) => void }) {
  const [url, setUrl] = useState("");
  const { busy, error, run } = useAction();
  return (
    <Dialog open={props.open} title="Add a webhook endpoint" onClose={props.onClose}>
      <form
        onSubmit={async (e) => {
          e.preventDefault();
          await run(async () => {
            const r = await api<{ secret: string }>("POST", props.base, { url: url.trim() });
            setUrl("");
            props.onAdded(r.secret);
          });
        }}
      >
        <Field
          id="webhook-url"
          label="URL"
          type="url"
          placeholder="https://example.com/cachet-alerts"
          value={url}
          onInput={(e) => setUrl(e.currentTarget.value)}
        />
        <FormFooter error={error} busy={busy} submit="Add" onCancel={props.onClose} />
      </form>
    </Dialog>
  );
}
