"""Output shared by the commands that show cloud resources."""

from __future__ import annotations


def print_resources(app, resources) -> None:
    now = app.session().clock.now()
    if not resources:
        app.console.text("no resources")
        return
    rows = []
    for res in resources:
        doc = res.as_dict(now)
        extra = []
        if "age_s" in doc:
            from provision.waiting import format_duration

            extra.append(f"age {format_duration(doc['age_s'])}")
        if "cost_usd" in doc:
            extra.append(f"${doc['cost_usd']:.2f} so far")
        if res.workers:
            extra.append(f"{len(res.workers)} workers")
        if res.error:
            extra.append(res.error)
        rows.append((res.kind, res.name, res.state, f"({', '.join(extra)})" if extra else ""))
    app.console.table(rows)


def finish(app, resources, result: str = "ok", **fields) -> None:
    now = app.session().clock.now()
    app.console.emit(app.document(result, resources=[r.as_dict(now) for r in resources], **fields))
