import "@picocss/pico/css/pico.min.css";
import "./style.css";
import { render } from "preact";
import { useEffect, useState } from "preact/hooks";
import { currentUser, logout, onSessionChange, refresh, type Me } from "./api";
import { match, navigate, usePath } from "./router";
import { LoginPage } from "./pages/login";
import { TenantsPage } from "./pages/tenants";
import { TenantPage } from "./pages/tenant";
import { UsersPage } from "./pages/users";
import { FinancePage, InvoicePage } from "./pages/finance";
import { AuditPage } from "./pages/audit";
import { AccountPage } from "./pages/account";
import { PricesPage } from "./pages/prices";

function home(me: Me): string {
  if (me.role === "tenant_admin" && me.tenant) return `/tenants/${me.tenant}/dashboard`;
  return "/tenants";
}

function Nav({ me }: { me: Me }) {
  const links: [string, string][] =
    me.role === "tenant_admin"
      ? [
          [`/tenants/${me.tenant}/dashboard`, "Dashboard"],
          [`/tenants/${me.tenant}/workspaces`, "Workspaces"],
          [`/tenants/${me.tenant}/keys`, "Keys"],
          [`/tenants/${me.tenant}/policy`, "Quotas & policy"],
          [`/tenants/${me.tenant}/cache`, "Cache"],
          [`/tenants/${me.tenant}/alerts`, "Alerts"],
          [`/tenants/${me.tenant}/audit`, "Audit log"],
        ]
      : me.role === "finance"
        ? [
            ["/tenants", "Tenants"],
            ["/finance", "Finance"],
          ]
        : [
            ["/tenants", "Tenants"],
            ["/users", "Users"],
            ["/finance", "Finance"],
            ["/audit", "Audit log"],
          ];
  const path = usePath();
  return (
    <nav class="top">
      <ul>
        <li>
          <strong>Cachet admin</strong>
        </li>
      </ul>
      <ul class="links">
        {links.map(([href, label]) => (
          <li key={href}>
            <a href={`#${href}`} aria-current={path.startsWith(href) ? "page" : undefined}>
              {label}
            </a>
          </li>
        ))}
        <li>
          <a class="who" href="#/account" title="Your account" aria-current={path === "/account" ? "page" : undefined}>
            {me.username} · {me.role.replace("_", " ")}
            {me.tenant_name ? ` · ${me.tenant_name}` : ""}
          </a>
        </li>
        <li>
          <button type="button" class="secondary outline" onClick={() => logout().then(() => navigate("/login"))}>
            Log out
          </button>
        </li>
      </ul>
    </nav>
  );
}

function Routes({ me, path }: { me: Me; path: string }) {
  let m: Record<string, string> | null;
  if ((m = match("/tenants/:id/:tab", path))) return <TenantPage me={me} id={m.id} tab={m.tab} />;
  if ((m = match("/tenants/:id", path))) return <TenantPage me={me} id={m.id} tab="dashboard" />;
  if (match("/tenants", path)) return <TenantsPage me={me} />;
  if (match("/users", path)) return <UsersPage me={me} />;
  if ((m = match("/finance/invoices/:id", path))) return <InvoicePage me={me} id={m.id} />;
  if (match("/finance/prices", path)) return <PricesPage me={me} />;
  if (match("/finance", path)) return <FinancePage me={me} />;
  if (match("/audit", path)) return <AuditPage me={me} tenant={null} />;
  if (match("/account", path)) return <AccountPage me={me} />;
  return (
    <section>
      <h1>Not found</h1>
      <p>
        There is no page at <code>{path}</code>. <a href={`#${home(me)}`}>Go to the start page</a>.
      </p>
    </section>
  );
}

function App() {
  const [me, setMe] = useState<Me | null>(currentUser());
  const [ready, setReady] = useState(false);
  const path = usePath();
  useEffect(() => onSessionChange(() => setMe(currentUser())), []);
  useEffect(() => {
    refresh().finally(() => setReady(true));
  }, []);
  useEffect(() => {
    if (!ready) return;
    if (!me && path !== "/login") navigate("/login");
    if (me && (path === "/login" || path === "/")) navigate(home(me));
  }, [me, path, ready]);
  if (!ready) return <main class="container" aria-busy="true" />;
  if (!me) {
    return (
      <main class="container narrow">
        <LoginPage />
      </main>
    );
  }
  return (
    <>
      <header class="container">
        <Nav me={me} />
      </header>
      <main class="container" id="main">
        <Routes me={me} path={path} />
      </main>
    </>
  );
}

render(<App />, document.getElementById("app")!);
