import { useState } from "preact/hooks";
import { api, type Me } from "../api";
import { Confirm, ErrorBanner, Field, Loaded, Notice, Table, useAction, useAsync } from "../components/ui";
import { formatTime } from "../format";
import { parsePrice } from "../forms";
import { type PriceVersion, perMillion, priceStates, times } from "../pricebook";

function AddPrice(props: { onAdded: (v: PriceVersion) => void }) {
  const blank = { model: "", from: "", currency: "USD", input: "", output: "", w5: "1.25", w1: "2", read: "0.1", storage: "1", backdate: false };
  const [f, setF] = useState(blank);
  const [errors, setErrors] = useState<Record<string, string>>({});
  const { busy, error, run } = useAction();
  const past = f.from !== "" && new Date(`${f.from}Z`) < new Date();
  const set = (k: keyof typeof blank) => (e: { currentTarget: HTMLInputElement }) => setF({ ...f, [k]: e.currentTarget.value });
  return (
    <form
      aria-label="Add a price version"
      onSubmit={async (e) => {
        e.preventDefault();
        const p = parsePrice(f, new Date());
        setErrors(p.errors);
        const price = p.value;
        if (!price) return;
        await run(async () => {
          await api("POST", "/v1/billing/prices", price);
          setF(blank);
          props.onAdded({ ...price });
        });
      }}
    >
      <h2>Add or schedule a price</h2>
      <div class="row">
        <Field id="price-model" label="Model" value={f.model} error={errors.model} onInput={set("model")} />
        <Field id="price-from" label="In force from (UTC)" type="datetime-local" value={f.from} error={errors.from} onInput={set("from")} />
        <Field id="price-currency" label="Currency" value={f.currency} error={errors.currency} onInput={set("currency")} />
      </div>
      <div class="row">
        <Field id="price-input" label="Input, per million tokens" value={f.input} error={errors.input} onInput={set("input")} />
        <Field id="price-output" label="Output, per million tokens" value={f.output} error={errors.output} onInput={set("output")} />
      </div>
      <div class="row">
        <Field id="price-w5" label="5-minute cache write (× input)" value={f.w5} error={errors.w5} onInput={set("w5")} />
        <Field id="price-w1" label="1-hour cache write (× input)" value={f.w1} error={errors.w1} onInput={set("w1")} />
        <Field id="price-read" label="Cache read (× input)" value={f.read} error={errors.read} onInput={set("read")} />
        <Field
          id="price-storage"
          label="Cache object held, per hour (× input)"
          value={f.storage}
          error={errors.storage}
          onInput={set("storage")}
        />
      </div>
      {past && (
        <label for="price-backdate">
          <input id="price-backdate" type="checkbox" checked={f.backdate} onChange={(e) => setF({ ...f, backdate: e.currentTarget.checked })} />
          This date is in the past: it corrects prices already in force (open drafts are re-priced when next rated; finalized
          invoices never change). It is audited as a correction.
        </label>
      )}
      <ErrorBanner error={error} />
      <button type="submit" aria-busy={busy} disabled={busy}>
        {past ? "Record the correction" : "Add price"}
      </button>
    </form>
  );
}

/** The price book: every list-price version, and (platform admins) a form to add one. */
export function PricesPage({ me }: { me: Me }) {
  const prices = useAsync(() => api<{ data: PriceVersion[] }>("GET", "/v1/billing/prices"), []);
  const [notice, setNotice] = useState<string | null>(null);
  const [retiring, setRetiring] = useState<PriceVersion | null>(null);
  if (me.role === "tenant_admin") return <p>The price book is for platform admins and finance.</p>;
  const now = new Date();
  const states = priceStates(prices.data?.data ?? [], now);
  const rows = [...(prices.data?.data ?? [])].sort(
    (a, b) => a.model.localeCompare(b.model) || b.effective_from.localeCompare(a.effective_from),
  );
  return (
    <section>
      <p>
        <a href="#/finance">← Finance</a>
      </p>
      <h1>Price book</h1>
      <p>
        List prices per model, versioned: a version is in force from its date until the next. A tenant's custom rates and plan
        discount apply on top. Cachet ships a list price for every model it serves; yours replace it from their date.
      </p>
      <Notice text={notice} />
      <Loaded state={prices} what="prices">
        <Table
          caption="List-price versions, newest first per model"
          columns={["Model", "From", "State", "Input / MTok", "Output / MTok", "5m write", "1h write", "Read", "Object held / h", me.role === "platform_admin" && "Actions"]}
          rows={rows} empty="No price yet." row={(p) => (
            <tr key={`${p.model}@${p.effective_from}`} data-state={states.get(p)}>
              <td>{p.model}</td>
              <td>{new Date(p.effective_from).getTime() <= 0 ? "always (shipped default)" : formatTime(p.effective_from)}</td>
              <td>{states.get(p)}</td>
              <td>
                {perMillion(p.input_nanos)} {p.currency}
              </td>
              <td>
                {perMillion(p.output_nanos)} {p.currency}
              </td>
              <td>{times(p.cache_write_5m_bp)}</td>
              <td>{times(p.cache_write_1h_bp)}</td>
              <td>{times(p.cache_read_bp)}</td>
              <td>{times(p.cache_storage_hour_bp)}</td>
              {me.role === "platform_admin" && (
                <td>
                  {states.get(p) === "scheduled" && (
                    <button
                      type="button"
                      class="danger"
                      aria-label={`Retire ${p.model} from ${p.effective_from}`}
                      onClick={() => setRetiring(p)}
                    >
                      Retire
                    </button>
                  )}
                </td>
              )}
            </tr>
          )}
        />
      </Loaded>
      <Confirm
        open={retiring !== null}
        title={`Retire the price of ${retiring?.model ?? ""}?`}
        body={
          <p>
            The version from {retiring ? formatTime(retiring.effective_from) : ""} is withdrawn and never takes effect; the price in
            force before it stays in force. A price already in force is changed by adding a newer version instead.
          </p>
        }
        action="Retire"
        danger
        onClose={() => setRetiring(null)}
        onConfirm={async () => {
          await api("POST", "/v1/billing/prices/retire", { model: retiring!.model, effective_from: retiring!.effective_from });
          setNotice(`The price of ${retiring!.model} from ${formatTime(retiring!.effective_from)} is retired.`);
          prices.reload();
        }}
      />
      {me.role === "platform_admin" && (
        <AddPrice
          onAdded={(v) => {
            setNotice(`Price of ${v.model} from ${formatTime(v.effective_from)} recorded.`);
            prices.reload();
          }}
        />
      )}
    </section>
  );
}
